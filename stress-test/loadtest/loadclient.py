"""One OpenAI-style request, timed: request bodies (JSON, or an audio upload), SSE parsing, error classification."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from loadtest.loadstats import OK, RequestRecord

WORKLOADS = ("chat-stream", "chat", "completions", "transcription", "embeddings")
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac", ".ogg", ".webm", ".m4a")

# Prompts of varied length (a few words to a few sentences), written for this tool.
PROMPTS: tuple[str, ...] = (
    "Say hello in French.",
    "Name two planets that have rings.",
    "What does a compiler do?",
    "Give three tips for sleeping better.",
    "Why do leaves change colour in autumn?",
    "Write a limerick about a forgetful robot.",
    "Explain recursion with an everyday example.",
    "How do I make a cup of green tea properly?",
    "What should a beginner know before running their first marathon?",
    "Describe a busy train station at rush hour in a few sentences.",
    "My bicycle chain keeps slipping when I pedal hard uphill. What are the likely causes and fixes?",
    "Write a short, friendly note to a colleague thanking them for covering my shift last Friday.",
    "A shop sells pens at 3 for 2 euros. How much do 12 pens cost? Show your reasoning.",
    "Summarize the pros and cons of working from home for a small software team.",
    "You are a museum guide. Introduce a painting of a stormy sea to a group of school children.",
    "List the steps to change a flat tyre on a car, from parking safely to stowing the tools.",
)


@dataclass(frozen=True)
class Clip:
    """An audio file to upload, and how long it plays."""

    name: str
    data: bytes
    seconds: float


def load_clips(audio_dir: Path) -> tuple[Clip, ...]:
    """Every audio file of a folder, in name order."""
    import librosa

    paths = sorted(p for p in audio_dir.iterdir() if p.suffix in AUDIO_SUFFIXES)
    if not paths:
        raise SystemExit(f"no audio files in {audio_dir}")
    return tuple(Clip(p.name, p.read_bytes(), float(librosa.get_duration(path=p))) for p in paths)


# Texts for /v1/embeddings: one to eight of the prompts run together (a few words to a paragraph of ~150 words).
EMBEDDING_TEXTS: tuple[str, ...] = tuple(" ".join(PROMPTS[i : i + 1 + i % 8]) for i in range(len(PROMPTS)))


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run sends (transcription: one of `clips`, chosen by the request's index)."""

    workload: str
    model: str
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True
    clips: tuple[Clip, ...] = ()
    models: tuple[str, ...] = ()  # when given, request `i` names `models[i % len(models)]` (e.g. LoRA adapters)

    def for_request(self, index: int) -> RequestSpec:
        """The spec of request `index`: its own `model` when the run goes round several."""
        return replace(self, model=self.models[index % len(self.models)]) if self.models else self

    @property
    def path(self) -> str:
        paths = {
            "completions": "/v1/completions",
            "transcription": "/v1/audio/transcriptions",
            "embeddings": "/v1/embeddings",
        }
        return paths.get(self.workload, "/v1/chat/completions")

    @property
    def streaming(self) -> bool:
        return self.workload not in ("chat", "embeddings")

    @property
    def prompts(self) -> tuple[str, ...]:
        """What `pick_prompt` chooses from: the prompts, or for transcription the clips' names."""
        if self.workload == "embeddings":
            return EMBEDDING_TEXTS
        return tuple(clip.name for clip in self.clips) if self.workload == "transcription" else PROMPTS

    @property
    def chat(self) -> bool:
        return self.workload != "completions"


def request_body(spec: RequestSpec, prompt: str) -> dict[str, Any]:
    """The JSON body for one request."""
    if spec.workload == "embeddings":
        return {"model": spec.model, "input": prompt}
    body: dict[str, Any] = {"model": spec.model, "max_tokens": spec.max_tokens, "temperature": spec.temperature}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if spec.streaming:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return body


def pick_prompt(index: int, prompts: Sequence[str] = PROMPTS) -> str:
    """Deterministic round-robin with a stride, so consecutive requests get different lengths."""
    return prompts[(index * 7) % len(prompts)]


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    """The text a streamed chunk carries (chat: delta.content, completions: text), '' if none."""
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if text:
            return str(text)
    return ""


def parse_retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class StreamTimer:
    """Collects the arrival times of text-bearing SSE chunks and the usage count, if sent."""

    def __init__(self, start: float, chat: bool) -> None:
        self.start, self.chat = start, chat
        self.stamps: list[float] = []
        self.usage_tokens: int | None = None
        self.error = ""

    def feed(self, line: str) -> bool:
        """Handle one SSE line; False once the stream is over ([DONE] or an error event)."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = json.dumps(chunk["error"])[:200]
            return False
        if chunk_text(chunk, self.chat):
            self.stamps.append(time.perf_counter())
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        return True

    def record(self, end: float) -> RequestRecord:
        if self.error:
            return RequestRecord("stream_error", e2e_s=end - self.start, detail=self.error)
        if not self.stamps:
            return RequestRecord("empty", e2e_s=end - self.start, detail="no text in the stream")
        gaps = [b - a for a, b in pairwise(self.stamps)]
        tokens = self.usage_tokens if self.usage_tokens is not None else len(self.stamps)
        return RequestRecord(OK, 0.0, end - self.start, self.stamps[0] - self.start, gaps, tokens)


async def _send_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool) -> RequestRecord:
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return await _http_error(resp, start)
        timer = StreamTimer(start, chat)
        async for line in resp.aiter_lines():
            if not timer.feed(line):
                break
    return timer.record(time.perf_counter())


async def _send_plain(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestRecord:
    start = time.perf_counter()
    resp = await client.post(url, json=body)
    if resp.status_code != 200:
        return await _http_error(resp, start)
    end = time.perf_counter()
    payload = resp.json()
    usage = payload.get("usage") or {}
    # Embeddings: a vector counts as one output (requests_per_s is then embeddings/s at one input a request).
    tokens = int(usage.get("completion_tokens") or 0) or sum(
        1 for item in payload.get("data") or () if item.get("object") == "embedding"
    )
    if tokens == 0:
        return RequestRecord("empty", e2e_s=end - start, detail="no completion tokens")
    return RequestRecord(OK, 0.0, end - start, None, [], tokens)


async def send_transcription(
    client: httpx.AsyncClient, url: str, clip: Clip, model: str, stream: bool = True
) -> RequestRecord:
    """One upload. Streamed: TTFT is the first `transcript.text.delta`, ITL the gaps between deltas; otherwise
    the whole response. `audio_s` is the clip's length."""
    start = time.perf_counter()
    data = {"model": model, **({"stream": "true"} if stream else {})}
    files = {"file": (clip.name, clip.data)}
    stamps: list[float] = []
    if stream:
        async with client.stream("POST", url, data=data, files=files) as resp:
            if resp.status_code != 200:
                return await _http_error(resp, start)
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    detail = json.dumps(event["error"])[:200]
                    return RequestRecord("stream_error", e2e_s=time.perf_counter() - start, detail=detail)
                if event.get("type") == "transcript.text.delta":
                    stamps.append(time.perf_counter())
    else:
        resp = await client.post(url, data=data, files=files)
        if resp.status_code != 200:
            return await _http_error(resp, start)
        if resp.json().get("text"):
            stamps.append(time.perf_counter())
    end = time.perf_counter()
    if not stamps:
        return RequestRecord("empty", e2e_s=end - start, detail="no text")
    gaps = [b - a for a, b in pairwise(stamps)]
    return RequestRecord(OK, 0.0, end - start, stamps[0] - start, gaps, 0, audio_s=clip.seconds)


async def _http_error(resp: httpx.Response, start: float) -> RequestRecord:
    detail = (await resp.aread()).decode(errors="replace")[:200]
    retry = parse_retry_after(resp.headers.get("retry-after"))
    return RequestRecord(
        f"http_{resp.status_code}", 0.0, time.perf_counter() - start, detail=detail, retry_after_s=retry
    )


async def send(
    client: httpx.AsyncClient, base_url: str, spec: RequestSpec, prompt: str, timeout_s: float
) -> RequestRecord:
    """Send one request and time it; never raises (failures become records with a non-ok status)."""
    url = base_url + spec.path
    start = time.perf_counter()
    try:
        if spec.workload == "transcription":
            clip = next(clip for clip in spec.clips if clip.name == prompt)
            coro = send_transcription(client, url, clip, spec.model)
        elif spec.streaming:
            coro = _send_stream(client, url, request_body(spec, prompt), spec.chat)
        else:
            coro = _send_plain(client, url, request_body(spec, prompt))
        return await asyncio.wait_for(coro, timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):  # noqa: UP041 - asyncio's is distinct before 3.11
        return RequestRecord("timeout", e2e_s=time.perf_counter() - start, detail=f"over {timeout_s:g} s")
    except asyncio.CancelledError:
        raise
    except httpx.TransportError as exc:
        return RequestRecord("connection", e2e_s=time.perf_counter() - start, detail=_exc_text(exc))
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON or chunk shape
        return RequestRecord("bad_response", e2e_s=time.perf_counter() - start, detail=_exc_text(exc))


def _exc_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]
