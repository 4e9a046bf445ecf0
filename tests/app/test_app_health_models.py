"""Start-up and discovery: /health, /ready and /get_load while loading, after and draining; /models with and
without /v1."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, MAX_MODEL_LEN, MODEL, assert_error, chat_body, make_app, make_context, running
from transformers_openai.api.app import create_app
from transformers_openai.settings import Settings


async def test_health_is_503_until_the_loader_finishes(fake: FakeEngine, hf_tokenizer: Any) -> None:
    release = threading.Event()

    def slow_loader():  # runs in a worker thread
        assert release.wait(10)
        return make_context(fake, hf_tokenizer)

    app = make_app(fake, hf_tokenizer, loader=slow_loader)
    try:
        async with running(app, wait_ready=False) as client:
            loading = await client.get("/health")
            error = assert_error(loading, 503)
            assert error["type"] == "service_unavailable"
            assert "loading" in error["message"]
            assert_error(await client.post(CHAT, json=chat_body()), 503)
            assert_error(await client.get("/ready"), 503)
            assert_error(await client.get("/get_load"), 503)
            assert_error(await client.get("/v1/models"), 503)
            assert not fake.submitted

            release.set()
            await app.state.serving.wait_ready()
            ready = await client.get("/health")
            assert ready.status_code == 200
            assert ready.json() == {"status": "ok", "engine": {"in_flight": 0, "submitted": 0}}
            assert fake.running
    finally:
        release.set()  # never leave the loader thread blocked
    assert not fake.running  # the lifespan stopped the engine


async def test_health_reports_a_failed_load() -> None:
    failures: list[bool] = []

    def broken_loader():
        raise RuntimeError("weights are missing")

    app = create_app(Settings(model=MODEL), loader=broken_loader, on_load_failure=lambda: failures.append(True))
    async with running(app, wait_ready=False) as client:
        await app.state.serving.wait_ready()
        error = assert_error(await client.get("/health"), 503)
        assert "weights are missing" in error["message"]
        assert failures == [True]


async def test_models_with_and_without_v1(client: httpx.AsyncClient) -> None:
    for path in ("/v1/models", "/models"):
        response = await client.get(path)
        assert response.status_code == 200
        body = response.json()
        assert body["object"] == "list"
        [card] = body["data"]
        assert card["id"] == MODEL
        assert card["object"] == "model"
        assert isinstance(card["created"], int)
        assert card["max_model_len"] == MAX_MODEL_LEN
        assert card["input_modalities"] == ["text"]


async def test_get_one_model(client: httpx.AsyncClient) -> None:
    for path in (f"/v1/models/{MODEL}", f"/models/{MODEL}"):
        response = await client.get(path)
        assert response.status_code == 200
        assert response.json()["id"] == MODEL


async def test_unknown_model_id_is_404_model_not_found(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/models/gpt-4o"), 404, param="model", code="model_not_found")
    assert_error(await client.get("/v1/models/org/other-model"), 404, code="model_not_found")


async def test_unknown_route_and_wrong_method_keep_the_error_shape(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nope"), 404)
    assert_error(await client.get(CHAT), 405)


async def test_ready_and_load_once_loaded_then_not_ready_while_draining(
    client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    assert (await client.get("/ready")).json() == {"status": "ready"}
    assert (await client.get("/get_load")).json() == {"load": 0}
    fake.in_flight.add("held")
    assert (await client.get("/get_load")).json() == {"load": 1}
    client_app_state = client._transport.app.state.serving  # type: ignore[attr-defined]
    client_app_state.begin_drain()
    error = assert_error(await client.get("/ready"), 503)
    assert "shutting down" in error["message"]
