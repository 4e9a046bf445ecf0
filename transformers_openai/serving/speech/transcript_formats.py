"""A finished transcript in OpenAI's five response formats: json, text, srt, vtt, verbose_json."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from transformers_openai.protocol.audio import (
    DurationUsage,
    ResponseFormat,
    Task,
    Transcription,
    TranscriptionSegment,
    TranscriptionVerbose,
    TranscriptionWord,
)
from transformers_openai.serving.speech.whisper_tokens import language_name

MEDIA_TYPES: dict[str, str] = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}


@dataclass
class Transcript:
    """What a transcription produced: segments in order (with their words when asked for)."""

    task: Task
    language: str  # ISO-639-1
    duration: float  # seconds of audio
    segments: list[TranscriptionSegment] = field(default_factory=list)
    words: list[TranscriptionWord] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments).strip()

    @property
    def usage(self) -> DurationUsage:
        return DurationUsage(seconds=math.ceil(self.duration))


def render(transcript: Transcript, response_format: ResponseFormat, word_timestamps: bool) -> BaseModel | str:
    """The response body: a model for the JSON formats, the plain string for the others."""
    if response_format == "json":
        return Transcription(text=transcript.text, usage=transcript.usage)
    if response_format == "verbose_json":
        return TranscriptionVerbose(
            task=transcript.task,
            language=language_name(transcript.language),
            duration=round(transcript.duration, 2),
            text=transcript.text,
            segments=transcript.segments,
            words=transcript.words if word_timestamps else None,
            usage=transcript.usage,
        )
    if response_format == "srt":
        return subrip(transcript.segments)
    if response_format == "vtt":
        return webvtt(transcript.segments)
    return transcript.text + "\n"


def subrip(segments: Sequence[TranscriptionSegment]) -> str:
    return "".join(srt_cue(number, segment) for number, segment in enumerate(segments, start=1))


def webvtt(segments: Sequence[TranscriptionSegment]) -> str:
    return "WEBVTT\n\n" + "".join(vtt_cue(segment) for segment in segments)


def srt_cue(number: int, segment: TranscriptionSegment) -> str:
    start, end = clock(segment.start, ","), clock(segment.end, ",")
    return f"{number}\n{start} --> {end}\n{_cue_text(segment.text)}\n\n"


def vtt_cue(segment: TranscriptionSegment) -> str:
    return f"{clock(segment.start, '.')} --> {clock(segment.end, '.')}\n{_cue_text(segment.text)}\n\n"


def clock(seconds: float, decimal_marker: str) -> str:
    """`HH:MM:SS,mmm` from whole milliseconds (float modulo would print 0.999 for whole seconds)."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{millis:03d}"


def _cue_text(text: str) -> str:
    # A blank line would end the cue early: a cue's text is one line, and "-->" would read as timing.
    return " ".join(text.split()).replace("-->", "->") or "..."
