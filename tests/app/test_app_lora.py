"""/v1/load_lora_adapter and /v1/unload_lora_adapter in-process (a fake engine): vLLM's shapes, the adapter a request
names reaches the engine, /v1/models lists adapters with their parent, and every bad input is our 4xx."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, ERROR_KEYS, MODEL, make_app, make_context, running
from transformers_openai.engine.lora_adapters import LoraAdapters, LoraLimits

SHAPES = {"model.layers.0.self_attn.q_proj": (8, 8)}


def _adapter_dir(path: Path, rank: int = 2) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 4}))
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{layer}.lora_A.weight": torch.zeros(rank, 8), f"{layer}.lora_B.weight": torch.zeros(8, rank)}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture
async def lora_client(fake: FakeEngine, hf_tokenizer: Any, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    _adapter_dir(tmp_path / "loras" / "ok")
    _adapter_dir(tmp_path / "loras" / "big", rank=32)
    limits = LoraLimits(max_loras=2, max_rank=16, dirs=(tmp_path / "loras",))
    adapters = LoraAdapters(MODEL, SHAPES, torch.float32, torch.device("cpu"), limits)
    context = replace(make_context(fake, hf_tokenizer), adapters=adapters)
    async with running(make_app(fake, hf_tokenizer, loader=lambda: context)) as ready:
        yield ready


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    error: dict[str, Any] = body["error"]
    return error


async def test_a_loaded_adapter_is_listed_requested_and_unloaded(
    lora_client: httpx.AsyncClient, fake: FakeEngine, tmp_path: Path
) -> None:
    path = str(tmp_path / "loras" / "ok")
    loaded = await lora_client.post("/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": path})
    assert loaded.status_code == 200 and "mine" in loaded.text
    cards = {card["id"]: card for card in (await lora_client.get("/v1/models")).json()["data"]}
    assert cards["mine"]["parent"] == MODEL and cards["mine"]["root"] == path
    assert (await lora_client.get("/v1/models/mine")).json()["parent"] == MODEL
    body = {"model": "mine", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await lora_client.post(CHAT, json=body)).status_code == 200
    base = await lora_client.post(CHAT, json={**body, "model": MODEL})
    assert base.status_code == 200
    adapter = fake.submitted[0].lora
    assert adapter is not None and adapter.name == "mine" and fake.submitted[1].lora is None
    unloaded = await lora_client.post("/unload_lora_adapter", json={"lora_name": "mine"})
    assert unloaded.status_code == 200
    assert _error(await lora_client.post(CHAT, json=body), 404)["code"] == "model_not_found"
    gone = await lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "mine"})
    assert _error(gone, 404)["code"] == "model_not_found"


BAD_LOADS: list[tuple[dict[str, Any], str, str]] = [
    ({"lora_name": "x", "lora_path": "{root}/loras/big"}, "lora_path", "--max-lora-rank"),
    ({"lora_name": "x", "lora_path": "{root}/elsewhere"}, "lora_path", "--lora-dir"),
    ({"lora_name": "x", "lora_path": "{root}/loras/none"}, "lora_path", "adapter_config.json"),
    ({"lora_name": MODEL, "lora_path": "{root}/loras/ok"}, "lora_name", "already served"),
    ({"lora_name": "", "lora_path": "{root}/loras/ok"}, "lora_name", ""),
    ({"lora_name": "x"}, "lora_path", ""),
    ({"lora_name": 3, "lora_path": "{root}/loras/ok"}, "lora_name", ""),
    ({"lora_name": "x\ud800", "lora_path": "{root}/loras/ok"}, "lora_name", ""),
    ({"lora_name": "x", "lora_path": "{root}/loras/ok", "extra": 1}, "extra", ""),
]


async def test_a_load_that_cannot_be_served_is_our_400(lora_client: httpx.AsyncClient, tmp_path: Path) -> None:
    for body, param, words in BAD_LOADS:
        filled = {key: value.format(root=tmp_path) if isinstance(value, str) else value for key, value in body.items()}
        response = await lora_client.post(
            "/v1/load_lora_adapter", content=json.dumps(filled).encode(), headers={"content-type": "application/json"}
        )
        error = _error(response, 400)
        assert (error["param"] or "").startswith(param) and words in error["message"], (body, error)
    assert "x" not in {card["id"] for card in (await lora_client.get("/v1/models")).json()["data"]}


async def test_behind_the_api_key_and_404_without_run_time_loading(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with running(make_app(fake, hf_tokenizer, api_keys=["k"])) as client:
        for prefix in ("/v1", ""):
            load, unload = f"{prefix}/load_lora_adapter", f"{prefix}/unload_lora_adapter"
            body = {"lora_name": "a", "lora_path": "/tmp/a"}
            _error(await client.post(load, json=body), 401)
            _error(await client.post(unload, json={"lora_name": "a"}), 401)
            key = {"Authorization": "Bearer k"}
            assert "--allow-runtime-lora" in _error(await client.post(load, json=body, headers=key), 404)["message"]
            _error(await client.post(unload, json={"lora_name": "a"}, headers=key), 404)
