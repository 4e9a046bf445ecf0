"""Several models in one app, each on its own fake engine: routing by `model`, 404s, the listing with states, loads on
demand, idle unloads, the memory budget, a failed load beside a serving model, and per-model metric labels."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
from fastapi import FastAPI

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import CHAT, assert_error, eventually, make_context, running
from transformers_openai.api.app import create_app
from transformers_openai.api.models_registry import ModelSource, RegistryPolicy
from transformers_openai.metrics import Metrics
from transformers_openai.serving.context import ServingContext
from transformers_openai.settings import Settings

GIB = 2**30


def _chat(model: str | None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    if model is not None:
        body["model"] = model
    return body


class Served:
    """Two or three named models on fake engines, their loads counted."""

    def __init__(self, hf_tokenizer: Any, names: tuple[str, ...] = ("alpha", "beta")) -> None:
        self.engines = {name: FakeEngine() for name in names}
        self.loads = dict.fromkeys(names, 0)
        self.broken: set[str] = set()
        self.tokenizer = hf_tokenizer
        self.metrics = Metrics(names[0])

    def loader(self, name: str) -> Callable[[], ServingContext]:
        def load() -> ServingContext:
            if name in self.broken:
                raise RuntimeError(f"weights of {name} are missing")
            self.loads[name] += 1
            self.engines[name] = engine = FakeEngine(self.engines[name].script)
            context = make_context(engine, self.tokenizer)
            return replace(context, model_name=name, model_aliases=frozenset({name, f"/models/{name}"}))

        return load

    def app(self, policy: RegistryPolicy | None = None, estimate_bytes: int = 0) -> FastAPI:
        sources = [
            ModelSource(
                name,
                frozenset({name, f"/models/{name}"}),
                self.loader(name),
                estimate_bytes=estimate_bytes,
                metrics=self.metrics if index == 0 else self.metrics.for_model(name),
            )
            for index, name in enumerate(self.engines)
        ]
        first = sources[0]
        return create_app(Settings(model=first.name), first.loader, metrics=self.metrics, models=sources, policy=policy)


async def _states(client: httpx.AsyncClient) -> dict[str, str]:
    response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"]: card["state"] for card in response.json()["data"]}


async def test_requests_go_to_the_model_they_name(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    async with running(served.app()) as client:
        assert await _states(client) == {"alpha": "loaded", "beta": "loaded"}  # both loaded at start: ready
        assert (await client.get("/get_load")).json() == {"load": 0}
        for name in ("beta", "alpha", "/models/beta"):
            response = await client.post(CHAT, json=_chat(name))
            assert response.status_code == 200, response.text
            assert response.json()["model"] == name  # echoed as asked, as before
        assert len(served.engines["alpha"].submitted) == 1
        assert len(served.engines["beta"].submitted) == 2
        # The first listed answers a request that names no model (tokenize's model is optional).
        assert (await client.post("/v1/tokenize", json={"prompt": "Hi"})).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'transformers_openai:requests_total{endpoint="chat_completions",model_name="beta"} 2.0' in metrics
        assert 'transformers_openai:requests_total{endpoint="chat_completions",model_name="alpha"} 1.0' in metrics


async def test_an_unknown_model_is_a_404_on_every_family(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    async with running(served.app()) as client:
        requests = [
            client.post(CHAT, json=_chat("gamma")),
            client.post("/v1/completions", json={"model": "gamma", "prompt": "Hi"}),
            client.post("/v1/embeddings", json={"model": "gamma", "input": "Hi"}),
            client.post("/v1/tokenize", json={"model": "gamma", "prompt": "Hi"}),
            client.post("/v1/responses", json={"model": "gamma", "input": "Hi"}),
            client.post("/v1/audio/transcriptions", data={"model": "gamma"}, files={"file": ("a.wav", b"RIFF")}),
            client.get("/v1/models/gamma"),
            client.get("/models/gamma"),
        ]
        for response in await asyncio.gather(*requests):
            error = assert_error(response, 404, param="model", code="model_not_found")
            assert "gamma" in error["message"] and "alpha, beta" in error["message"]
        messages = await client.post("/v1/messages", json={"model": "gamma", "max_tokens": 5, "messages": []})
        assert messages.status_code == 404
        assert messages.json()["error"]["type"] == "not_found_error"  # Anthropic's shape on its route
        assert not any(engine.submitted for engine in served.engines.values())


async def test_models_are_listed_with_their_state(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    async with running(served.app(RegistryPolicy(load_on_demand=True))) as client:
        assert await _states(client) == {"alpha": "unloaded", "beta": "unloaded"}
        assert (await client.get("/ready")).status_code == 200  # nothing is loaded at start
        assert (await client.post(CHAT, json=_chat("beta"))).status_code == 200
        assert await _states(client) == {"alpha": "unloaded", "beta": "loaded"}
        card = (await client.get("/v1/models/beta")).json()
        assert card["state"] == "loaded" and card["input_modalities"] == ["text"] and card["max_model_len"] > 0
        health = (await client.get("/health")).json()
        assert health["models"]["alpha"] == {"state": "unloaded", "engine": None}
        assert health["models"]["beta"]["state"] == "loaded"
        assert served.loads == {"alpha": 0, "beta": 1}


async def test_an_idle_model_is_unloaded_and_loads_again(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    app = served.app(RegistryPolicy(load_on_demand=True, idle_unload_s=0.3))
    async with running(app) as client:
        assert (await client.post(CHAT, json=_chat("alpha"))).status_code == 200
        first = served.engines["alpha"]
        assert first.running
        assert await eventually(lambda: not first.running, timeout=5)  # stopped once idle
        assert (await _states(client))["alpha"] == "unloaded"
        assert (await client.post(CHAT, json=_chat("alpha"))).status_code == 200
        assert served.loads["alpha"] == 2 and served.engines["alpha"].running


async def test_a_stream_in_flight_keeps_its_model(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    served.engines["alpha"].script = Script(hang=True)
    app = served.app(RegistryPolicy(load_on_demand=True, idle_unload_s=0.2))
    async with running(app) as client:
        stream = asyncio.create_task(client.post(CHAT, json=_chat("alpha", stream=True)))
        assert await eventually(lambda: bool(served.engines["alpha"].in_flight), timeout=5)
        await asyncio.sleep(0.8)  # four idle periods: still held
        assert served.engines["alpha"].running
        stream.cancel()


async def test_the_budget_evicts_the_idle_model_or_refuses(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    policy = RegistryPolicy(load_on_demand=True, budget_bytes=int(1.5 * GIB))
    async with running(served.app(policy, estimate_bytes=GIB)) as client:
        assert (await client.post(CHAT, json=_chat("alpha"))).status_code == 200
        assert (await client.post(CHAT, json=_chat("beta"))).status_code == 200  # alpha made room
        assert await _states(client) == {"alpha": "unloaded", "beta": "loaded"}
        served.engines["beta"].script = Script(hang=True)
        held = asyncio.create_task(client.post(CHAT, json=_chat("beta")))
        assert await eventually(lambda: bool(served.engines["beta"].in_flight), timeout=5)
        refused = await client.post(CHAT, json=_chat("alpha"))  # beta is busy: no room
        error = assert_error(refused, 503, param="model", code="model_unavailable")
        assert "alpha" in error["message"] and "budget" in error["message"]
        assert int(refused.headers["retry-after"]) > 0
        assert served.engines["beta"].running and served.loads["alpha"] == 1
        held.cancel()


async def test_a_model_past_the_whole_budget_is_refused(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    async with running(served.app(RegistryPolicy(load_on_demand=True, budget_bytes=GIB), 2 * GIB)) as client:
        error = assert_error(await client.post(CHAT, json=_chat("alpha")), 503, code="model_unavailable")
        assert "more than the whole memory budget" in error["message"]


async def test_a_failed_load_leaves_the_other_models_serving(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    served.broken.add("beta")
    async with running(served.app(RegistryPolicy(load_on_demand=True))) as client:
        assert (await client.post(CHAT, json=_chat("alpha"))).status_code == 200
        error = assert_error(await client.post(CHAT, json=_chat("beta")), 503)
        assert "weights of beta are missing" in error["message"]
        assert (await _states(client))["beta"] == "failed"
        assert (await client.post(CHAT, json=_chat("alpha"))).status_code == 200
        served.broken.clear()  # fixed on disk: the next request loads it
        assert (await client.post(CHAT, json=_chat("beta"))).status_code == 200


BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/embeddings": {"input": "Hi"},
    "/v1/tokenize": {"prompt": "Hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
}


async def test_bad_model_fields_get_clear_errors(hf_tokenizer: Any) -> None:
    served = Served(hf_tokenizer)
    async with running(served.app(RegistryPolicy(load_on_demand=True))) as client:
        for model, status in ((123, 400), (None, 400), (["alpha"], 400), ({"id": "alpha"}, 400), ("", 404)):
            for path, fields in BODIES.items():
                response = await client.post(path, json={"model": model, **fields})
                if path == "/v1/tokenize" and model is None:
                    continue  # tokenize's model is optional: the first listed answers
                assert response.status_code == status, (path, model, response.text)
        long_name = "m" * 100_000
        error = assert_error(await client.post(CHAT, json=_chat(long_name)), 404, code="model_not_found")
        assert long_name in error["message"]
        no_model = await client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")})
        assert_error(no_model, 400)
        assert served.loads["beta"] == 0  # no bad request loaded a model it did not name
