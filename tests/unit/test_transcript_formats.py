"""The five response formats: OpenAI's shapes, and subtitles that real parsers read back."""

from __future__ import annotations

import io

import srt
import webvtt

from transformers_openai.protocol.audio import Transcription, TranscriptionSegment, TranscriptionVerbose
from transformers_openai.serving.speech.transcript_formats import Transcript, clock, render


def segment(i: int, start: float, end: float, text: str) -> TranscriptionSegment:
    return TranscriptionSegment(
        id=i,
        seek=0,
        start=start,
        end=end,
        text=text,
        tokens=[1, 2],
        temperature=0.0,
        avg_logprob=-0.2,
        compression_ratio=1.3,
        no_speech_prob=0.01,
    )


TRANSCRIPT = Transcript(
    task="transcribe",
    language="en",
    duration=61.48,
    segments=[segment(0, 0.0, 3.0, " Hello there."), segment(1, 3.0, 61.2, " Second --> line\n\nhere.")],
)


def test_clock_splits_whole_milliseconds() -> None:
    assert clock(3.0, ",") == "00:00:03,000"  # not 00:00:02,999
    assert clock(0.29, ".") == "00:00:00.290"
    assert clock(3725.5, ",") == "01:02:05,500"


def test_json_and_verbose_json() -> None:
    body = render(TRANSCRIPT, "json", False)
    assert isinstance(body, Transcription)
    assert body.model_dump() == {
        "text": "Hello there. Second --> line\n\nhere.",
        "usage": {"type": "duration", "seconds": 62},
    }
    verbose = render(TRANSCRIPT, "verbose_json", False)
    assert isinstance(verbose, TranscriptionVerbose)
    dumped = verbose.model_dump(exclude_none=True)
    assert dumped["language"] == "english" and dumped["task"] == "transcribe" and dumped["duration"] == 61.48
    assert "words" not in dumped and dumped["segments"][0]["text"] == " Hello there."
    assert render(TRANSCRIPT, "text", False) == "Hello there. Second --> line\n\nhere.\n"


def test_srt_parses_back() -> None:
    body = render(TRANSCRIPT, "srt", False)
    assert isinstance(body, str) and body.startswith("1\n00:00:00,000 --> 00:00:03,000\nHello there.\n\n2\n")
    cues = list(srt.parse(body))
    assert [c.index for c in cues] == [1, 2]
    assert [c.start.total_seconds() for c in cues] == [0.0, 3.0]
    assert cues[1].end.total_seconds() == 61.2 and cues[1].content == "Second -> line here."


def test_vtt_parses_back() -> None:
    body = render(TRANSCRIPT, "vtt", False)
    assert isinstance(body, str) and body.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:03.000\nHello there.\n\n")
    cues = webvtt.from_buffer(io.StringIO(body)).captions
    assert [(c.start, c.end, c.text) for c in cues] == [
        ("00:00:00.000", "00:00:03.000", "Hello there."),
        ("00:00:03.000", "00:01:01.200", "Second -> line here."),
    ]
