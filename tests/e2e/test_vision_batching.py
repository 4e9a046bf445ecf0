"""A tiny LLaVA-NeXT served with a K/V budget far below its batch: 8 concurrent chats with 0, 1 or 2 images (PNG data
URLs) of several sizes and texts each get the greedy text of the model's own `generate` on that chat alone, while
requests are preempted and recomputed with their images; the same image and text again reuses its cached prefix."""

from __future__ import annotations

import asyncio
import base64
import io
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from tests.e2e.conftest import async_client
from tests.e2e.server import ServerProcess, start_server
from tests.vision_models import tiny_vlm

FAMILY = "llava-next"
MAX_TOKENS = 60
# The tiny model's K/V take 512 bytes a token: 160 KiB are 19 blocks of 16 tokens (one kept zero), 304 tokens, which
# hold the largest chat below (about 200 prompt tokens) but not the 8 of them together.
BUDGET = "160KiB"
CHATS: list[tuple[list[tuple[int, int]], str]] = [
    ([(40, 30)], "What is in this picture?"),
    ([], "Say hello."),
    ([(30, 30), (64, 48)], "Compare these two images."),
    ([(50, 70)], "Describe."),
    ([], "A longer text-only request that goes on for a while."),
    ([(36, 36), (30, 60)], "Which one?"),
    ([(60, 30)], "Colours?"),
    ([(45, 45)], "Count the shapes in the image and name them."),
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_vlm(FAMILY)


@pytest.fixture(scope="module")
def vision_server(model_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(model_dir, server_logs, "--max-batch-size", "8", "--kv-cache-memory", BUDGET)
    yield server
    server.stop()


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(index: int) -> tuple[list[Image.Image], str]:
    sizes, text = CHATS[index]
    return [image(10 * index + j, size) for j, size in enumerate(sizes)], text


def message(images: list[Image.Image], text: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}] if images else text}


@lru_cache(maxsize=1)
def _loaded(model_dir: str) -> tuple[Any, Any]:
    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def reference(model_dir: Path, images: list[Image.Image], text: str) -> str:
    """The model's own greedy text for this chat alone, up to EOS or MAX_TOKENS."""
    model, processor = _loaded(str(model_dir))
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}] if images else text
    rendered = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=rendered, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = processor.tokenizer.eos_token_id
    return str(processor.tokenizer.decode(new[: new.index(eos)] if eos in new else new, skip_special_tokens=True))


def metric(text: str, name: str, default: float | None = None) -> float:
    """A metric's value; `default` for a counter not yet incremented (its line appears with its first rise)."""
    match = re.search(rf"^transformers_openai:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    if match is None and default is not None:
        return default
    assert match, name
    return float(match.group(1))


def answers(server: ServerProcess, messages: list[dict[str, Any]]) -> list[str]:
    async def burst() -> list[str]:
        client = async_client(server)

        async def one(chat_message: dict[str, Any]) -> str:
            response = await client.chat.completions.create(
                model=server.model,
                messages=[chat_message],  # type: ignore[list-item]
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            return response.choices[0].message.content or ""

        try:
            return list(await asyncio.gather(*(one(m) for m in messages)))
        finally:
            await client.close()

    return asyncio.run(burst())


def test_concurrent_image_chats_preempted_give_each_chats_own_greedy_text(
    vision_server: ServerProcess, model_dir: Path
) -> None:
    chats = [chat(i) for i in range(len(CHATS))]
    got = answers(vision_server, [message(images, text) for images, text in chats])
    for index, (images, text) in enumerate(chats):
        assert got[index] == reference(model_dir, images, text), (index, len(images), text)
    metrics = httpx.get(f"{vision_server.root_url}/metrics", timeout=10).text
    assert "num_preemptions_total{" in metrics, "no request was preempted"
    assert metric(metrics, "num_preemptions_total") > 0
    assert metric(metrics, "kv_cache_blocks_used") == 0

    # The first chat twice more, one after the other: the second finds the first's blocks (the first may not find
    # the burst's, which the small pool may have given to others).
    images, text = chats[0]
    assert answers(vision_server, [message(images, text)]) == [got[0]]
    # The burst may have evicted the first chat's blocks: no hit counted yet is possible here.
    hits = metric(httpx.get(f"{vision_server.root_url}/metrics", timeout=10).text, "prefix_cache_hits_total", 0.0)
    assert answers(vision_server, [message(images, text)]) == [got[0]]
    after = metric(httpx.get(f"{vision_server.root_url}/metrics", timeout=10).text, "prefix_cache_hits_total")
    assert after - hits >= 16
