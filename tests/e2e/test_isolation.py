"""A request that once failed every request in the engine (top_k = 2**63) now gets its own 400; the streams
running beside it finish with the same text as `model.generate` alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai

from tests.e2e import reference
from tests.e2e.conftest import async_client
from tests.e2e.server import ServerProcess

PROMPTS = ["Name a color.", "What is the capital of France?", "1, 2, 3, 4,"]
MAX_TOKENS = 24


async def test_top_k_2_pow_63_among_three_streams_is_one_400_and_three_normal_answers(
    tiny_server: ServerProcess, tiny_llama_dir: Path
) -> None:
    client = async_client(tiny_server)

    async def stream(prompt: str) -> str:
        chunks = await client.completions.create(
            model=tiny_server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])

    async def hostile() -> BaseException | None:
        await asyncio.sleep(0.2)  # while the three are decoding
        try:
            await client.completions.create(
                model=tiny_server.model,
                prompt="x",
                max_tokens=8,
                temperature=1.0,
                stream=True,
                extra_body={"top_k": 2**63},
            )
        except openai.BadRequestError as exc:
            return exc
        return None

    try:
        async with asyncio.timeout(120):
            *texts, rejected = await asyncio.gather(*(stream(p) for p in PROMPTS), hostile())
    finally:
        await client.close()

    assert isinstance(rejected, openai.BadRequestError)
    assert rejected.status_code == 400 and rejected.body["param"] == "top_k"  # type: ignore[index]
    for prompt, text in zip(PROMPTS, texts, strict=True):
        expected = reference.greedy(tiny_llama_dir, reference.text_prompt_ids(tiny_llama_dir, prompt), MAX_TOKENS)
        assert text == expected.text, prompt
    assert httpx.get(f"{tiny_server.root_url}/health", timeout=10).json()["engine"]["rows_in_use"] == 0
