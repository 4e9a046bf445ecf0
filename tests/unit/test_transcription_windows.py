"""The transcription handler on a fake engine: its windows are named by keys the server makes (never the client's
X-Request-Id), what the runner kept for them is released however the transcription ends, uploads wait their turn
to decode (and a client may leave while waiting), a decode out of memory is a 503, and a request naming a LoRA
adapter sends every window with it."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from safetensors.torch import save_file
from transformers import AutoFeatureExtractor, AutoTokenizer

from transformers_openai.engine.lora_adapters import LoraAdapters, LoraLimits
from transformers_openai.engine.request import EngineRequest, FinishReason, RequestOutput
from transformers_openai.protocol.audio import TranscriptionRequest
from transformers_openai.serving.context import ServingContext, SpeechModel
from transformers_openai.serving.disconnect import ClientDisconnected
from transformers_openai.serving.errors import InternalServerError, ModelNotFoundError, ServiceUnavailableError
from transformers_openai.serving.speech import transcription
from transformers_openai.serving.speech.audio import decode_audio
from transformers_openai.serving.speech.transcription import TranscriptionHandler
from transformers_openai.serving.speech.whisper_tokens import WhisperTokens
from transformers_openai.serving.tokenizer import TokenizerService

MODEL = "whisper"


class FakeSpeechCalls:
    """The speech model's own calls: only the release of kept windows is recorded."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def detect_language(
        self,
        features: Any,
        sot: int,
        language_tokens: Sequence[int],
        window: tuple[str, int] | None = None,
        lora: Any = None,
    ) -> int:
        raise AssertionError("these tests name the language")

    async def alignment_weights(self, features: Any, tokens: list[int], lora: Any = None) -> Any:
        raise AssertionError("these tests ask for no word times")

    async def release_windows(self, key: str) -> None:
        self.released.append(key)


class FakeEngine:
    """Answers every window with `tokens` (or an error, or nothing at all); `runner` records the speech calls."""

    def __init__(self, tokens: list[int], outcome: str = "finish") -> None:
        self.tokens = tokens
        self.outcome = outcome
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.runner = FakeSpeechCalls()
        self.running = True

    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        self.requests.extend(requests)
        return [self._stream(request) for request in requests]

    async def _stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self.outcome == "hang":
            await asyncio.Event().wait()
        failed = self.outcome == "fail"
        yield RequestOutput(
            request_id=request.request_id,
            text="",
            token_ids=[] if failed else self.tokens,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(self.tokens),
            finish_reason=FinishReason.ERROR if failed else FinishReason.STOP,
            error="boom" if failed else None,
        )

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture(scope="module")
def parts(whisper_dir: Path) -> tuple[Any, Any, TokenizerService]:
    tokenizer = AutoTokenizer.from_pretrained(whisper_dir)
    return tokenizer, AutoFeatureExtractor.from_pretrained(whisper_dir), TokenizerService(tokenizer, workers=1)


def handler(
    parts: tuple[Any, Any, TokenizerService],
    engine: FakeEngine,
    decodes: int = 2,
    adapters: LoraAdapters | None = None,
) -> TranscriptionHandler:
    tokenizer, features, service = parts
    tokens = WhisperTokens.from_tokenizer(tokenizer, False)
    speech = SpeechModel(features, tokens, engine.runner, 60.0, max_audio_decodes=decodes)
    ctx = ServingContext(
        engine=engine,  # type: ignore[arg-type]
        tokenizer=service,
        model_name=MODEL,
        model_aliases=frozenset({MODEL}),
        max_model_len=448,
        model_kind="whisper",
        speech=speech,
        adapters=adapters,
    )
    return TranscriptionHandler(ctx)


def clip(seed: int) -> bytes:
    buffer = io.BytesIO()
    noise = np.random.default_rng(seed).standard_normal(16000).astype(np.float32) * 0.1
    soundfile.write(buffer, noise, 16000, format="WAV")
    return buffer.getvalue()


def window_tokens(parts: tuple[Any, Any, TokenizerService]) -> list[int]:
    tokens = WhisperTokens.from_tokenizer(parts[0], False)
    text = parts[0].encode(" Hello there.", add_special_tokens=False)
    return [tokens.timestamp_begin, *text, tokens.timestamp_begin + 50, tokens.eot]


async def never() -> None:
    await asyncio.Event().wait()


async def gone() -> None:
    return None


async def settled() -> None:
    for _ in range(5):  # the releases are tasks of their own
        await asyncio.sleep(0)


def test_two_clips_under_one_client_id_get_windows_of_their_own_each_released(
    parts: tuple[Any, Any, TokenizerService],
) -> None:
    engine = FakeEngine(window_tokens(parts))
    serving = handler(parts, engine)

    async def run() -> list[Any]:
        results = []
        for seed in (1, 2):
            body = TranscriptionRequest(audio=clip(seed), filename="a.wav", model=MODEL)
            results.append(await serving.create(body, never, request_id="victim-42"))
        await settled()
        return results

    results = asyncio.run(run())
    assert [r.text for r in results] == ["Hello there.", "Hello there."]
    keys = [request.encoder_inputs["window"][0] for request in engine.requests]
    assert len(keys) == 2 and keys[0] != keys[1]
    assert not any("victim-42" in key for key in keys)
    assert not any("victim-42" in request.request_id for request in engine.requests)
    assert engine.runner.released == keys  # nothing kept once each ended


def test_a_failed_window_releases_what_was_kept(parts: tuple[Any, Any, TokenizerService]) -> None:
    engine = FakeEngine(window_tokens(parts), outcome="fail")
    serving = handler(parts, engine)

    async def run() -> None:
        with pytest.raises(InternalServerError):
            await serving.create(TranscriptionRequest(audio=clip(1), filename="a.wav", model=MODEL), never)
        await settled()

    asyncio.run(run())
    assert engine.runner.released == [engine.requests[0].encoder_inputs["window"][0]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_its_window_and_releases_it(
    parts: tuple[Any, Any, TokenizerService], stream: bool
) -> None:
    engine = FakeEngine(window_tokens(parts), outcome="hang")
    serving = handler(parts, engine)

    async def run() -> None:
        body = TranscriptionRequest(audio=clip(1), filename="a.wav", model=MODEL, stream=stream)
        if stream:
            events = await serving.create(body, never)
            consumer = asyncio.ensure_future(anext(events))  # type: ignore[arg-type]
            await asyncio.sleep(0.05)
            consumer.cancel()  # the SSE helper's task, cancelled when its client leaves
            with pytest.raises(asyncio.CancelledError):
                await consumer
            await events.aclose()  # type: ignore[union-attr]
        else:
            with pytest.raises(ClientDisconnected):
                await serving.create(body, gone)
        await settled()

    asyncio.run(run())
    assert set(engine.aborted) == {engine.requests[0].request_id}
    assert engine.runner.released == [engine.requests[0].encoder_inputs["window"][0]]


def test_uploads_wait_for_a_decode_slot_and_may_leave_while_waiting(
    parts: tuple[Any, Any, TokenizerService], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FakeEngine(window_tokens(parts))
    serving = handler(parts, engine, decodes=1)
    decoding = 0
    most = 0
    real = decode_audio  # the function transcription calls by this name

    def counted(*args: Any, **kwargs: Any) -> np.ndarray:
        nonlocal decoding, most
        decoding += 1
        most = max(most, decoding)
        try:
            return real(*args, **kwargs)
        finally:
            decoding -= 1

    monkeypatch.setattr(transcription, "decode_audio", counted)

    async def run() -> None:
        bodies = [TranscriptionRequest(audio=clip(seed), filename="a.wav", model=MODEL) for seed in range(4)]
        await asyncio.gather(*(serving.create(body, never) for body in bodies))
        async with serving._decodes:  # the slot is taken: an upload waits for it, and its client leaves
            with pytest.raises(ClientDisconnected):
                await serving.create(bodies[0], gone)

    asyncio.run(run())
    assert most == 1 and len(engine.requests) == 4


def test_a_decode_out_of_memory_is_a_503(
    parts: tuple[Any, Any, TokenizerService], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> np.ndarray:
        raise MemoryError

    monkeypatch.setattr(transcription, "decode_audio", no_memory)
    serving = handler(parts, FakeEngine(window_tokens(parts)))
    with pytest.raises(ServiceUnavailableError) as caught:
        asyncio.run(serving.create(TranscriptionRequest(audio=clip(1), filename="a.wav", model=MODEL), never))
    assert caught.value.status_code == 503 and caught.value.param == "file"


class TokenByTokenEngine(FakeEngine):
    """Answers every window one token per output, and records how many outputs each window had sent when the
    handler passed its stream an event (the consumer reads events one by one)."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.sent = 0

    async def _stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        for at, token in enumerate(self.tokens):
            self.sent = at + 1
            last = at == len(self.tokens) - 1
            yield RequestOutput(
                request_id=request.request_id,
                text="",
                token_ids=[token],
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=at + 1,
                finish_reason=FinishReason.STOP if last else None,
                info={"no_speech_prob": 0.01} if at == 0 else None,
            )


@pytest.mark.parametrize("fallback", [False, True])
def test_a_stream_without_fallback_sends_each_word_as_it_is_decoded(
    parts: tuple[Any, Any, TokenizerService], fallback: bool
) -> None:
    engine = TokenByTokenEngine(window_tokens(parts))
    serving = handler(parts, engine)

    async def run() -> list[tuple[str, str, int]]:
        body = TranscriptionRequest(audio=clip(1), filename="a.wav", model=MODEL, stream=True, fallback=fallback)
        events = await serving.create(body, never)
        seen = []
        async for event in events:  # type: ignore[union-attr]
            fields = event.model_dump()
            seen.append((fields["type"], fields.get("delta", fields.get("text", "")), engine.sent))
        return seen

    seen = asyncio.run(run())
    deltas = [(text, sent) for kind, text, sent in seen if kind == "transcript.text.delta"]
    assert seen[-1][:2] == ("transcript.text.done", "Hello there.")
    assert "".join(text for text, _ in deltas) == "Hello there."
    if fallback:  # a retry could still take the window's text back: it comes once the window is done
        assert deltas == [("Hello there.", len(engine.tokens))]
    else:  # the timestamp, then a word per token
        assert deltas[0] == ("Hello", 2) and len(deltas) >= 2 and deltas[-1][1] < len(engine.tokens)


def test_a_request_naming_an_adapter_sends_every_window_with_it(
    parts: tuple[Any, Any, TokenizerService], tmp_path: Path
) -> None:
    layer = "model.decoder.layers.0.self_attn.q_proj"
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 4}')
    pair = {"lora_A.weight": torch.ones(2, 4), "lora_B.weight": torch.ones(4, 2)}
    save_file(
        {f"base_model.model.{layer}.{name}": t for name, t in pair.items()}, str(tmp_path / "adapter_model.safetensors")
    )
    adapters = LoraAdapters(MODEL, {layer: (4, 4)}, torch.float32, torch.device("cpu"), LoraLimits(2, 8))
    adapter = adapters.load("accent", tmp_path)
    engine = FakeEngine(window_tokens(parts))
    serving = handler(parts, engine, adapters=adapters)

    async def run(model: str) -> Any:
        return await serving.create(TranscriptionRequest(audio=clip(1), filename="a.wav", model=model), never)

    assert asyncio.run(run("accent")).text == "Hello there."
    assert asyncio.run(run(MODEL)).text == "Hello there."
    assert [request.lora is adapter for request in engine.requests] == [True, False]
    assert engine.requests[1].lora is None
    with pytest.raises(ModelNotFoundError):
        asyncio.run(run("no-such-adapter"))
