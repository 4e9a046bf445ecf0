"""The OpenAI wire protocol of /v1/audio/transcriptions and /v1/audio/translations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Literal

from pydantic import BaseModel, Field

ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]
Granularity = Literal["segment", "word"]
Task = Literal["transcribe", "translate"]


@dataclass(frozen=True)
class TranscriptionRequest:
    """A transcription or translation as the form gave it, fields checked."""

    audio: bytes | BinaryIO  # the file's bytes, or the seekable file the upload was spooled to
    filename: str
    model: str
    task: Task = "transcribe"
    language: str | None = None  # ISO-639-1
    prompt: str | None = None
    response_format: ResponseFormat = "json"
    temperature: float = 0.0
    fallback: bool = True  # retry a rejected window hotter (temperature not given); off: `temperature` alone
    granularities: frozenset[Granularity] = frozenset()
    stream: bool = False

    @property
    def word_timestamps(self) -> bool:
        return "word" in self.granularities


class DurationUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: int  # of audio, rounded up


class Transcription(BaseModel):
    """`response_format=json`."""

    text: str
    usage: DurationUsage


class TranscriptionWord(BaseModel):
    word: str
    start: float
    end: float


class TranscriptionSegment(BaseModel):
    id: int
    seek: int  # mel frames (100 per second) where the segment's window starts
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionVerbose(BaseModel):
    """`response_format=verbose_json`: `segments` unless only words were asked for, `words` when they were."""

    task: Task
    language: str  # the full lower-case English name, e.g. "english"
    duration: float
    text: str
    segments: list[TranscriptionSegment] | None = Field(default=None, exclude_if=lambda value: value is None)
    words: list[TranscriptionWord] | None = Field(default=None, exclude_if=lambda value: value is None)
    usage: DurationUsage


class TranscriptTextDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptTextSegment(BaseModel):
    """Sent with `stream=true` and `response_format` `srt` or `vtt`: one finished cue."""

    type: Literal["transcript.text.segment"] = "transcript.text.segment"
    id: str
    start: float
    end: float
    text: str


class TranscriptTextDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: DurationUsage
