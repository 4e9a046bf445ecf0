"""LoRA adapters per request on the tiny Llama: rows with adapter A, adapter B and none share batches, and each
answer is its own `PeftModel.generate` greedy answer alone, also when a small K/V pool preempts rows; an adapter loaded
at run time serves the next request, and unloaded it is a 404."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import NotFoundError

from tests.e2e import reference
from tests.e2e.conftest import async_client, sync_client
from tests.e2e.server import ServerProcess, start_server
from tests.model_factory import build_tiny_lora, cache_root

BUDGET = "200KiB"  # 24 blocks of 16 tokens: eight rows of 70 tokens do not fit at once


@pytest.fixture(scope="module")
def lora_dir(tiny_llama_dir: Path) -> Path:
    root = cache_root() / "tiny-llama-loras"
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        build_tiny_lora(root / name, tiny_llama_dir, seed=seed)
    return root


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir: Path, lora_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    modules = f"adapter-a={lora_dir / 'a'},adapter-b={lora_dir / 'b'}"
    args = ["--lora-modules", modules, "--allow-runtime-lora", "--lora-dir", str(lora_dir), "--max-loras", "3"]
    server = start_server(tiny_llama_dir, server_logs, "--max-batch-size", "8", "--kv-cache-memory", BUDGET, *args)
    yield server
    server.stop()


def preemptions(server: ServerProcess) -> float:
    text = httpx.get(f"{server.root_url}/metrics", timeout=10).text
    match = re.search(r"^transformers_openai:num_preemptions_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@lru_cache(maxsize=4)
def _peft_model(base: Path, adapter: Path | None) -> Any:
    from peft import PeftModel

    model, _ = reference.load(str(base))
    if adapter is None:
        return model
    fresh = type(model).from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    return PeftModel.from_pretrained(fresh, adapter).eval()


def peft_greedy(base: Path, adapter: Path | None, prompt: str, max_tokens: int) -> str:
    """`PeftModel.generate` greedy on this prompt alone (the base model's own without an adapter)."""
    _, tokenizer = reference.load(str(base))
    ids = torch.tensor([reference.text_prompt_ids(base, prompt)])
    with torch.inference_mode():
        out = _peft_model(base, adapter).generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False)
    text: str = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return text


async def _complete(server: ServerProcess, jobs: list[tuple[str, str, bool]], max_tokens: int) -> list[str]:
    """Every (model, prompt, stream) at once; the texts in order."""
    client = async_client(server)

    async def one(model: str, prompt: str, stream: bool) -> str:
        if not stream:
            response = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
            return response.choices[0].text
        chunks = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])

    try:
        return list(await asyncio.gather(*(one(*job) for job in jobs)))
    finally:
        await client.close()


def _expected(base: Path, lora_dir: Path, jobs: list[tuple[str, str, bool]], max_tokens: int) -> list[str]:
    paths = {"adapter-a": lora_dir / "a", "adapter-b": lora_dir / "b", "test-model": None}
    return [peft_greedy(base, paths[model], prompt, max_tokens) for model, prompt, _ in jobs]


def test_adapters_and_the_base_in_one_batch_answer_as_peft_alone(
    lora_server: ServerProcess, tiny_llama_dir: Path, lora_dir: Path
) -> None:
    models = ["adapter-a", "adapter-b", "test-model"]
    # The same prompt under each adapter too: prefix blocks and identical prompts are never shared across adapters.
    jobs = [(models[i % 3], f"Note {i // 3}: the weather", i % 2 == 0) for i in range(12)]
    texts = asyncio.run(_complete(lora_server, jobs, 16))
    assert texts == _expected(tiny_llama_dir, lora_dir, jobs, 16)
    assert len({text for (_, prompt, _), text in zip(jobs, texts, strict=True) if prompt.startswith("Note 0")}) == 3
    listed = {card.id: card for card in sync_client(lora_server).models.list().data}
    assert listed["adapter-a"].parent == "test-model" and listed["adapter-b"].parent == "test-model"  # type: ignore[attr-defined]


def test_preempted_adapter_rows_keep_their_adapter(
    lora_server: ServerProcess, tiny_llama_dir: Path, lora_dir: Path
) -> None:
    models = ["adapter-a", "adapter-b", "test-model", "adapter-a"]
    jobs = [(models[i % 4], f"Item {i}: a line about rivers and nothing else", False) for i in range(8)]
    before = preemptions(lora_server)
    texts = asyncio.run(_complete(lora_server, jobs, 60))
    assert preemptions(lora_server) > before
    assert texts == _expected(tiny_llama_dir, lora_dir, jobs, 60)


def test_an_adapter_loaded_at_run_time_serves_then_unloaded_is_a_404(
    lora_server: ServerProcess, tiny_llama_dir: Path, lora_dir: Path
) -> None:
    url = lora_server.base_url
    loaded = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "c", "lora_path": str(lora_dir / "c")})
    assert loaded.status_code == 200, loaded.text
    client = sync_client(lora_server)
    prompt = "A short story:"
    text = client.completions.create(model="c", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert text == peft_greedy(tiny_llama_dir, lora_dir / "c", prompt, 12)
    assert "c" in {card.id for card in client.models.list().data}
    again = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "d", "lora_path": str(lora_dir / "c")})
    assert again.status_code == 400 and "--max-loras" in again.json()["error"]["message"]
    outside = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "e", "lora_path": str(tiny_llama_dir)})
    assert outside.status_code == 400 and "--lora-dir" in outside.json()["error"]["message"]
    unloaded = httpx.post(f"{lora_server.root_url}/unload_lora_adapter", json={"lora_name": "c"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(NotFoundError) as caught:
        client.completions.create(model="c", prompt=prompt, max_tokens=4)
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
    missing = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
