"""The realtime WebSocket in process: the API key on the handshake (header or OpenAI's browser subprotocol), the
refusals a server gives before any session opens (in OpenAI's error shape), the session bound, idle sessions
closed, a malformed event answered on the socket. The speech model is a stub no turn reaches (turns:
tests/unit/test_realtime_session.py and tests/e2e/test_realtime.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from tests.app.fake_engine import FakeEngine
from tests.app.support import BASE_URL, ERROR_KEYS, MODEL, make_app, make_context
from transformers_openai.api.app import create_app
from transformers_openai.serving.context import Capability, SpeechModel
from transformers_openai.settings import Settings

KEY = "key-a"
WS_ROOT = BASE_URL.replace("http://", "ws://", 1)  # a host name the Host check takes


@pytest.fixture(scope="module")
def keyed(hf_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """One app for the module (its handshakes change nothing in it), with its own Batch API folder."""
    data_dir = tmp_path_factory.mktemp("batch-data")
    app = make_app(FakeEngine(), hf_tokenizer, api_keys=[KEY], data_dir=data_dir)
    with TestClient(app, base_url=BASE_URL) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:  # the model loads in a worker thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield client


def refusal(client: TestClient, path: str, **options: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(WebSocketDenialResponse) as denied, client.websocket_connect(WS_ROOT + path, **options):
        pass
    body = denied.value.json()
    assert set(body["error"]) == ERROR_KEYS
    return denied.value.status_code, body["error"]


@pytest.mark.parametrize("path", ["/v1/realtime?intent=transcription", "/realtime"])
def test_a_handshake_without_the_key_gets_401(keyed: TestClient, path: str) -> None:
    status, error = refusal(keyed, path)
    assert status == 401 and error["code"] == "invalid_api_key", error
    status, _ = refusal(keyed, path, headers={"authorization": "Bearer wrong"})
    assert status == 401
    status, _ = refusal(keyed, path, subprotocols=["realtime", "openai-insecure-api-key.wrong"])
    assert status == 401


@pytest.mark.parametrize(
    "options",
    [
        {"headers": {"authorization": f"Bearer {KEY}"}},
        {"subprotocols": ["realtime", f"openai-insecure-api-key.{KEY}", "openai-beta.realtime-v1"]},
    ],
)
def test_the_key_lets_a_handshake_through_to_the_model_check(keyed: TestClient, options: dict[str, Any]) -> None:
    # Past the key, the served model (a text model here) is what refuses the session.
    status, error = refusal(keyed, "/v1/realtime?intent=transcription", **options)
    assert status == 400 and error["code"] == "model_not_supported" and "audio" in error["message"]


def test_another_intent_is_refused_before_the_model(keyed: TestClient) -> None:
    status, error = refusal(keyed, "/v1/realtime?intent=conversation", headers={"authorization": f"Bearer {KEY}"})
    assert status == 400 and error["param"] == "intent"


def speech_app(hf_tokenizer: Any, data_dir: Any, **settings: Any) -> TestClient:
    """An app whose model takes audio (a stub: sessions open, and no turn is transcribed)."""
    context = make_context(FakeEngine(), hf_tokenizer)
    context.speech = SpeechModel(feature_extractor=None, tokens=None, calls=None, max_audio_seconds=60)  # type: ignore[arg-type]
    context.capabilities = frozenset({Capability.SPEECH})
    app = create_app(Settings(model=MODEL, data_dir=data_dir, **settings), loader=lambda: context)
    return TestClient(app, base_url=BASE_URL)


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 60
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_sessions_past_the_bound_get_429_and_an_idle_one_is_closed(hf_tokenizer: Any, tmp_path: Any) -> None:
    app = speech_app(hf_tokenizer, tmp_path, max_realtime_sessions=1, realtime_idle_timeout=0.5)
    with app as client:
        wait_ready(client)
        with client.websocket_connect(f"{WS_ROOT}/v1/realtime?intent=transcription") as ws:
            assert ws.receive_json()["type"] == "transcription_session.created"
            status, error = refusal(client, "/v1/realtime?intent=transcription")
            assert status == 429 and error["type"] == "rate_limit_error"
            ws.send_text('{"type": "input_audio_buffer.commit", "event_id": "e1"}')
            error = ws.receive_json()["error"]
            assert error["code"] == "input_audio_buffer_commit_empty" and error["event_id"] == "e1"
            ws.send_bytes(b"\x00\x01")
            assert ws.receive_json()["error"]["code"] == "invalid_event"
            # Then nothing for longer than the idle timeout.
            closing = ws.receive_json()
            assert closing["type"] == "error" and closing["error"]["code"] == "session_idle_timeout"
            assert ws.receive()["code"] == 1001
        # The slot is free again.
        with client.websocket_connect(f"{WS_ROOT}/realtime") as ws:
            assert ws.receive_json()["session"]["input_audio_transcription"]["model"] == MODEL
