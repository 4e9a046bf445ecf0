"""A LoRA adapter on the tiny T5 (query and value projections of its encoder, decoder and cross-attention): rows
naming it, batched beside rows of the base model, each give their own `PeftModel.generate` greedy answer alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from tests.e2e import reference
from tests.e2e.conftest import async_client
from tests.e2e.server import ServerProcess

MAX_TOKENS = 12
PROMPTS = ["Hello there, friend", "A quiet river bends"]


def peft_greedy(base: Path, adapter: Path, prompt: str) -> str:
    """`PeftModel.generate` greedy on this prompt alone."""
    from peft import PeftModel

    model, tokenizer = reference.load(str(base))
    fresh = type(model).from_pretrained(base, dtype=torch.float32)
    peft = PeftModel.from_pretrained(fresh, adapter).eval()
    ids = torch.tensor([reference.text_prompt_ids(base, prompt)])
    with torch.inference_mode():
        out = peft.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    text: str = tokenizer.decode(out[0, 1:], skip_special_tokens=True)  # after the decoder's start token
    return text


async def _complete(server: ServerProcess, jobs: list[tuple[str, str]]) -> list[str]:
    client = async_client(server)

    async def one(model: str, prompt: str) -> str:
        response = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return response.choices[0].text

    try:
        return list(await asyncio.gather(*(one(model, prompt) for model, prompt in jobs)))
    finally:
        await client.close()


def test_t5_adapter_rows_beside_base_rows_answer_as_peft_alone(
    tiny_t5_server: ServerProcess, tiny_t5_dir: Path, tiny_t5_lora: Path
) -> None:
    jobs = [(model, prompt) for prompt in PROMPTS for model in ("t5-a", "test-model")]
    texts = asyncio.run(_complete(tiny_t5_server, jobs))
    expected = [
        peft_greedy(tiny_t5_dir, tiny_t5_lora, prompt)
        if model == "t5-a"
        else reference.greedy_text(tiny_t5_dir, reference.text_prompt_ids(tiny_t5_dir, prompt), MAX_TOKENS)[0]
        for model, prompt in jobs
    ]
    assert texts == expected
    assert texts[0] != texts[1] and texts[2] != texts[3]  # the adapter changes the answers: it is applied
