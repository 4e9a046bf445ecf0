"""Transcriptions and translations: long-form Whisper decoding, window after window, on the shared engine.

Each 30 s window is one engine request, so the windows of many requests share the batch. A request's next
window is submitted when its previous one finishes (a continuation: admitted even at capacity, ahead of the
queue). The rules are OpenAI whisper's: the seek follows the last timestamp, the previous text is the next
window's prompt, a window whose text is repetitive or unlikely is decoded again hotter (the encoder output is
reused), a window that is likely silence is skipped.

A transcription's windows are named by a key the server makes (never the client's X-Request-Id, which only names
the log lines): the runner keeps a window's encoder output under that key, and drops it when the transcription ends.
A request naming a LoRA adapter of the model (`model: "<adapter>"`) has every pass over its audio run with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel

from transformers_openai.engine.intra_op_threads import one_torch_thread
from transformers_openai.engine.lora_adapters import LoraAdapter
from transformers_openai.engine.request import EngineRequest, RequestOutput
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.protocol.audio import (
    TranscriptionRequest,
    TranscriptionSegment,
    TranscriptionWord,
    TranscriptTextDelta,
    TranscriptTextDone,
    TranscriptTextSegment,
)
from transformers_openai.serving.base import check_output
from transformers_openai.serving.context import ServingContext, SpeechModel
from transformers_openai.serving.disconnect import WaitDisconnect, until_disconnect
from transformers_openai.serving.errors import BadRequestError, ServiceUnavailableError
from transformers_openai.serving.speech.audio import decode_audio
from transformers_openai.serving.speech.live_text import SentText, WindowPlace, WindowText
from transformers_openai.serving.speech.longform import (
    FRAMES_PER_POSITION,
    FRAMES_PER_SECOND,
    PROMPT_RESET_TEMPERATURE,
    WINDOW_FRAMES,
    Attempt,
    SegmentTokens,
    split_window,
    temperatures,
)
from transformers_openai.serving.speech.transcript_formats import Transcript, render
from transformers_openai.serving.speech.word_timing import SegmentSpan, alignment_rows, word_timestamps

logger = logging.getLogger(__name__)

MAX_TOKENS_PER_WINDOW = 224  # half the decoder's 448 positions, as OpenAI samples


@dataclass
class _Audio:
    """A request's audio, ready to decode: log-mel features with 30 s of silence after the content."""

    features: np.ndarray  # [n_mels, content_frames + 3000]
    content_frames: int
    duration: float


@dataclass(frozen=True)
class _Job:
    """A transcription's key (names its engine requests and the windows the runner keeps) and its LoRA adapter."""

    key: str
    lora: LoraAdapter | None


@dataclass
class _Progress:
    """Where a transcription stands."""

    request_id: str  # for the log lines: the client's X-Request-Id, or the transcription's key
    transcript: Transcript
    started: float = field(default_factory=time.monotonic)
    first_text_at: float | None = None
    windows: int = 0
    tokens: int = 0


class TranscriptionHandler:
    """Serves /v1/audio/transcriptions and /v1/audio/translations for a speech model."""

    def __init__(self, ctx: ServingContext) -> None:
        if ctx.speech is None:
            raise ValueError("a transcription handler needs a speech model")
        self.ctx = ctx
        self.speech: SpeechModel = ctx.speech
        # Uploads decoded at once: each holds up to the length limit's samples and its features while it decodes.
        self._decodes = asyncio.Semaphore(self.speech.max_audio_decodes)
        self._releases: set[asyncio.Task[None]] = set()
        self._decoder = ctx.tokenizer.decoder_copy()  # streamed text, decoded token by token on the event loop

    async def create(
        self, request: TranscriptionRequest, wait_disconnect: WaitDisconnect, request_id: str | None = None
    ) -> BaseModel | str | AsyncIterator[BaseModel]:
        """The response body (a model, or the string of text/srt/vtt), or a stream of events."""
        self.ctx.check_model(request.model)
        language = self._language(request)
        job = _Job(uuid.uuid4().hex, self.ctx.adapter(request.model))
        log_id = request_id or job.key
        audio = await self._decoded(request, wait_disconnect, log_id)
        prompt = await self._prompt(request)
        try:
            if language is None:
                language = await self._detect_language(audio, job)
            progress = _Progress(log_id, Transcript(task=request.task, language=language, duration=audio.duration))
            # The first window goes in now, so a full server answers 429 before any response starts.
            first = self._submit(job, 0, 0, self._prefix(request, language, prompt), audio, request.temperature)
        except BaseException:
            self._release(job.key)
            raise
        segments = self._segments(job, request, language, audio, prompt, progress, first)
        if request.stream:
            return self._events(request, progress, segments)
        await until_disconnect(self._collect(segments), wait_disconnect, log_id)
        self._finished(request, progress)
        return render(progress.transcript, request.response_format, request.word_timestamps)

    # -- request checks and preparation
    def _language(self, request: TranscriptionRequest) -> str | None:
        tokens = self.speech.tokens
        if request.task == "translate" and not tokens.multilingual:
            raise BadRequestError(
                "this model is English-only and cannot translate; use /v1/audio/transcriptions", param="model"
            )
        if request.language is None:
            return None if tokens.multilingual else "en"
        code = request.language.strip().lower()
        if not tokens.multilingual:
            if code != "en":
                raise BadRequestError(
                    f"this model is English-only; language '{request.language}' is not supported", param="language"
                )
            return code
        if code not in tokens.languages:
            raise BadRequestError(
                f"'{request.language}' is not a language this model knows (ISO-639-1 codes such as 'en', 'de')",
                param="language",
            )
        return code

    async def _decoded(self, request: TranscriptionRequest, wait_disconnect: WaitDisconnect, log_id: str) -> _Audio:
        """The request's audio, decoded when a decode slot is free (a client that leaves while waiting for one is
        let go); the slot is held until the worker thread is done, even when the request is cancelled meanwhile."""
        await until_disconnect(self._decodes.acquire(), wait_disconnect, log_id)
        work = asyncio.ensure_future(asyncio.to_thread(one_torch_thread(self._prepare), request))
        work.add_done_callback(lambda _: self._decodes.release())
        return await asyncio.shield(work)

    def _prepare(self, request: TranscriptionRequest) -> _Audio:
        """Decodes the file and computes its log-mel features (blocking: runs in a worker thread)."""
        try:
            return self._features(request)
        except MemoryError as exc:
            raise ServiceUnavailableError(
                "the server has no memory free to decode this audio now; retry later or send a shorter file",
                param="file",
                code="out_of_memory",
            ) from exc

    def _features(self, request: TranscriptionRequest) -> _Audio:
        speech = self.speech
        rate = speech.sampling_rate
        samples = decode_audio(request.audio, rate, speech.max_audio_seconds, request.filename)
        padded = np.concatenate([samples, np.zeros(WINDOW_FRAMES * speech.hop_length, dtype=np.float32)])
        features = speech.feature_extractor(
            padded, sampling_rate=rate, truncation=False, padding="do_not_pad", return_tensors="np"
        ).input_features[0]
        content = samples.size // speech.hop_length
        return _Audio(np.ascontiguousarray(features[:, : content + WINDOW_FRAMES]), content, samples.size / rate)

    async def _prompt(self, request: TranscriptionRequest) -> list[int]:
        if not request.prompt or not request.prompt.strip():
            return []
        ids = await self.ctx.tokenizer.encode_text(" " + request.prompt.strip(), add_special_tokens=False)
        return [token for token in ids if token < self.speech.tokens.eot]

    async def _detect_language(self, audio: _Audio, job: _Job) -> str:
        """One decoder step on the first window; its encoder output is kept for that window's decoding."""
        tokens = self.speech.tokens
        window = np.ascontiguousarray(audio.features[:, :WINDOW_FRAMES])
        candidates = dict(tokens.languages)
        calls = self.speech.calls
        best = await calls.detect_language(window, tokens.sot, list(candidates.values()), (job.key, 0), job.lora)
        return next(code for code, token in candidates.items() if token == best)

    def _prefix(self, request: TranscriptionRequest, language: str, previous: list[int]) -> list[int]:
        return self.speech.tokens.prefix(
            language=language if self.speech.tokens.multilingual else None,
            task=request.task,
            timestamps=True,
            previous=previous,
        )

    # -- decoding, window after window
    def _submit(
        self,
        job: _Job,
        window: int,
        attempt: int,
        prefix: list[int],
        audio: _Audio,
        temperature: float,
        seek: int = 0,
    ) -> tuple[str, AsyncIterator[RequestOutput]]:
        """Sends one decoding of one window to the engine; later windows and retries are continuations."""
        engine_id = f"{job.key}-w{window}-t{attempt}"
        limit = min(MAX_TOKENS_PER_WINDOW, self.ctx.max_model_len - len(prefix))
        params = SamplingParams(max_tokens=limit, temperature=temperature, logprobs=0)
        features = np.ascontiguousarray(audio.features[:, seek : seek + WINDOW_FRAMES])
        inputs = {"input_features": features, "window": (job.key, window)}
        continuation = window > 0 or attempt > 0
        request = EngineRequest(
            engine_id, prefix, params, encoder_inputs=inputs, continuation=continuation, lora=job.lora
        )
        return engine_id, self.ctx.engine.submit([request])[0]

    async def _segments(
        self,
        job: _Job,
        request: TranscriptionRequest,
        language: str,
        audio: _Audio,
        prompt: list[int],
        progress: _Progress,
        first: tuple[str, AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[TranscriptionSegment | str]:
        """The segments in order, as their windows finish, and before them the text of the window in decoding that
        no later token can take back (streams with fallback off); closing it early aborts the window in flight."""
        tokens = self.speech.tokens
        carried, reset_since = list(prompt), 0
        seek, window, last_speech = 0, 0, 0.0
        pending: tuple[str, AsyncIterator[RequestOutput]] | None = first
        transcript = progress.transcript
        try:
            while seek < audio.content_frames:
                size = min(WINDOW_FRAMES, audio.content_frames - seek)
                prefix = self._prefix(request, language, carried[reset_since:])
                live = self._live_text(request, audio, seek)
                attempt: Attempt | None = None
                decoding = self._decode_window(job, window, prefix, audio, seek, request, pending, live)
                async with contextlib.aclosing(decoding):
                    async for item in decoding:
                        if isinstance(item, Attempt):
                            attempt = item
                        else:
                            yield item
                assert attempt is not None
                pending = None
                window += 1
                progress.windows += 1
                progress.tokens += len(attempt.tokens)
                if attempt.is_silence:
                    seek += size
                    continue
                split = split_window(attempt.tokens, tokens.eot, tokens.timestamp_begin, size)
                start = seek / FRAMES_PER_SECOND
                bounds = [(start + part.start, start + part.end) for part in split.segments]
                words: list[list[TranscriptionWord]] = [[] for _ in split.segments]
                if request.word_timestamps and split.segments:
                    bounds, words, last_speech = await self._words(
                        job, audio, seek, size, split.segments, bounds, last_speech, language
                    )
                for part, (seg_start, seg_end), seg_words in zip(split.segments, bounds, words, strict=True):
                    seg_end = min(seg_end, transcript.duration)
                    if seg_end <= seg_start:
                        continue
                    segment = TranscriptionSegment(
                        id=len(transcript.segments),
                        seek=seek,
                        start=round(seg_start, 2),
                        end=round(seg_end, 2),
                        text=await self.ctx.tokenizer.decode(part.text_tokens),
                        tokens=part.tokens,
                        temperature=attempt.temperature,
                        avg_logprob=attempt.avg_logprob,
                        compression_ratio=attempt.compression_ratio,
                        no_speech_prob=attempt.no_speech_prob,
                    )
                    transcript.segments.append(segment)
                    transcript.words.extend(seg_words)
                    if progress.first_text_at is None and segment.text.strip():
                        progress.first_text_at = time.monotonic()
                    yield segment
                carried.extend(token for part in split.segments for token in part.tokens)
                if attempt.temperature > PROMPT_RESET_TEMPERATURE:
                    reset_since = len(carried)
                seek += split.advance
        finally:
            if pending is not None:
                self.ctx.engine.abort(pending[0])
            self._release(job.key)

    def _release(self, key: str) -> None:
        """Has the runner drop what it kept for the transcription's windows (on the engine thread, after the
        aborts already sent); not awaited, so that it also runs from a cancelled request."""
        task = asyncio.get_running_loop().create_task(self._forget(key))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _forget(self, key: str) -> None:
        with contextlib.suppress(Exception):  # a stopped engine keeps nothing; a runner without windows neither
            await self.speech.calls.release_windows(key)

    def _live_text(self, request: TranscriptionRequest, audio: _Audio, seek: int) -> WindowText | None:
        """What streams a window's text token by token: only when no retry can take it back (fallback off) and
        word times cannot move its segments' bounds."""
        if not request.stream or request.fallback or request.word_timestamps:
            return None
        tokens = self.speech.tokens
        place = WindowPlace(start=seek / FRAMES_PER_SECOND, duration=audio.duration)
        return WindowText(self._decoder, tokens.eot, tokens.timestamp_begin, place)

    async def _decode_window(
        self,
        job: _Job,
        window: int,
        prefix: list[int],
        audio: _Audio,
        seek: int,
        request: TranscriptionRequest,
        pending: tuple[str, AsyncIterator[RequestOutput]] | None,
        live: WindowText | None,
    ) -> AsyncGenerator[str | Attempt, None]:
        """Decodes a window, again at higher temperatures while its text looks repetitive or unlikely (with
        fallback on); yields the text `live` vouches for as it comes, then the attempt kept."""
        schedule = temperatures(request.temperature) if request.fallback else [request.temperature]
        attempt: Attempt | None = None
        for number, hotter in enumerate(schedule):
            if number == 0 and pending is not None:
                engine_id, stream = pending
            else:
                engine_id, stream = self._submit(job, window, number, prefix, audio, hotter, seek)
            outputs = self._attempt(engine_id, stream, hotter, live)
            async with contextlib.aclosing(outputs):
                async for item in outputs:
                    if isinstance(item, Attempt):
                        attempt = item
                    else:
                        yield item
            assert attempt is not None
            if not attempt.needs_fallback:
                break
        assert attempt is not None
        yield attempt

    async def _attempt(
        self, engine_id: str, stream: AsyncIterator[RequestOutput], temperature: float, live: WindowText | None
    ) -> AsyncGenerator[str | Attempt, None]:
        """One decoding of a window: the text `live` vouches for as its tokens come, then the attempt."""
        eot = self.speech.tokens.eot
        sampled: list[int] = []
        logprob_sum = 0.0
        no_speech = 0.0
        try:
            async for output in stream:
                check_output(output)
                sampled.extend(output.token_ids)
                logprob_sum += sum(entry.logprob for entry in output.logprobs or ())
                if output.info:
                    no_speech = float(output.info.get("no_speech_prob", no_speech))
                piece = live.push(list(output.token_ids), no_speech) if live is not None else ""
                if piece:
                    yield piece
        finally:
            self.ctx.engine.abort(engine_id)
        if sampled and sampled[-1] == eot:
            sampled.pop()
        text = await self.ctx.tokenizer.decode([token for token in sampled if token < eot])
        yield Attempt(sampled, logprob_sum, temperature, no_speech, text)

    async def _words(
        self,
        job: _Job,
        audio: _Audio,
        seek: int,
        size: int,
        parts: list[SegmentTokens],
        bounds: list[tuple[float, float]],
        last_speech: float,
        language: str,
    ) -> tuple[list[tuple[float, float]], list[list[TranscriptionWord]], float]:
        """Word times of one window from its alignment heads (one teacher-forced pass on the engine thread)."""
        tokens = self.speech.tokens
        text = [token for part in parts for token in part.text_tokens]
        spans, at = [], 0
        for part, (start, end) in zip(parts, bounds, strict=True):
            spans.append(SegmentSpan(start, end, at, at + len(part.text_tokens)))
            at += len(part.text_tokens)
        forced = [*self._untimed_prefix(language), *text, tokens.eot]
        window = np.ascontiguousarray(audio.features[:, seek : seek + WINDOW_FRAMES])
        weights = await self.speech.calls.alignment_weights(window, forced, job.lora)
        timed = await asyncio.to_thread(
            one_torch_thread(word_timestamps),
            alignment_rows(weights, len(text)),
            num_frames=size // FRAMES_PER_POSITION,
            text_tokens=text,
            decode=self.ctx.tokenizer.decode_now,
            window_start=seek / FRAMES_PER_SECOND,
            segments=spans,
            last_speech_time=last_speech,
            language=language,
        )
        words: list[list[TranscriptionWord]] = [[] for _ in parts]
        for word in timed.words:
            words[word.segment].append(TranscriptionWord(word=word.word.strip(), start=word.start, end=word.end))
        return timed.segments, words, timed.last_speech_time

    def _untimed_prefix(self, language: str) -> list[int]:
        tokens = self.speech.tokens
        return tokens.prefix(
            language=language if tokens.multilingual else None, task="transcribe", timestamps=False, previous=[]
        )

    async def _collect(self, segments: AsyncIterator[TranscriptionSegment | str]) -> None:
        async for _ in segments:
            pass

    async def _events(
        self, request: TranscriptionRequest, progress: _Progress, segments: AsyncIterator[TranscriptionSegment | str]
    ) -> AsyncIterator[BaseModel]:
        """`transcript.text.delta` events as text becomes final (live text, then what each finished segment adds to
        it), `transcript.text.segment` cues for srt/vtt, then `transcript.text.done`."""
        text = SentText(progress.request_id)
        cues = request.response_format in ("srt", "vtt")
        try:
            async for item in segments:
                delta = text.add_live(item) if isinstance(item, str) else text.add_segment(item.text)
                if delta:
                    yield TranscriptTextDelta(delta=delta)
                if cues and isinstance(item, TranscriptionSegment):
                    yield TranscriptTextSegment(
                        id=f"seg_{item.id}", start=item.start, end=item.end, text=item.text.strip()
                    )
            transcript = progress.transcript
            yield TranscriptTextDone(text=transcript.text, usage=transcript.usage)
            self._finished(request, progress)
        finally:
            await segments.aclose()  # type: ignore[attr-defined]

    def _finished(self, request: TranscriptionRequest, progress: _Progress) -> None:
        request_id = progress.request_id
        elapsed = time.monotonic() - progress.started
        audio_s = progress.transcript.duration
        rtf = elapsed / audio_s if audio_s > 0 else 0.0
        ttft = (progress.first_text_at - progress.started) if progress.first_text_at else None
        logger.info(
            "transcription %s finished: audio=%.2fs windows=%d tokens=%d time_to_first_text=%s rtf=%.3f",
            request_id,
            audio_s,
            progress.windows,
            progress.tokens,
            "-" if ttft is None else f"{ttft:.3f}s",
            rtf,
            extra={
                "request_id": request_id,
                "audio_seconds": audio_s,
                "windows": progress.windows,
                "tokens": progress.tokens,
                "time_to_first_text_s": ttft,
                "real_time_factor": rtf,
            },
        )
        if self.speech.observer is not None:
            endpoint = "translations" if request.task == "translate" else "transcriptions"
            self.speech.observer.on_transcription(endpoint, audio_s, rtf)
