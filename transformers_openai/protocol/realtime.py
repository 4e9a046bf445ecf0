"""Realtime transcription sessions: the client events a `/v1/realtime?intent=transcription` WebSocket takes.

Two session shapes are read: the beta one (`transcription_session.update` with `input_audio_format`,
`input_audio_transcription`, `turn_detection`) and the GA one the openai 3.x client sends (`session.update` with
`{"type": "transcription", "audio": {"input": {...}}}`). Both become one `SessionConfig`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from transformers_openai.protocol.base import Strict, Text

AudioFormat = Literal["pcm16", "g711_ulaw", "g711_alaw"]
GA_FORMATS: dict[str, AudioFormat] = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
SAMPLE_RATES: dict[AudioFormat, int] = {"pcm16": 24000, "g711_ulaw": 8000, "g711_alaw": 8000}


class ServerVad(Strict):
    """Voice activity detection on the server: it commits a turn once speech is followed by silence."""

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="Higher needs louder audio to count as speech")
    prefix_padding_ms: int = Field(300, ge=0, le=10_000, description="Audio kept before the speech starts")
    silence_duration_ms: int = Field(500, ge=50, le=10_000, description="Silence that ends a turn")
    # Fields of OpenAI's conversation sessions; a transcription session has no response to create or interrupt.
    create_response: bool | None = None
    interrupt_response: bool | None = None


class InputTranscription(Strict):
    model: Text | None = None
    language: Text | None = None
    prompt: Text | None = None


class BetaSession(Strict):
    """`transcription_session.update`'s session."""

    input_audio_format: AudioFormat | None = None
    input_audio_transcription: InputTranscription | None = None
    turn_detection: ServerVad | None = None  # null: the client commits each turn
    input_audio_noise_reduction: None = None
    include: list[Literal["item.input_audio_transcription.logprobs"]] | None = Field(None, max_length=0)


class GaFormat(Strict):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: Literal[24000] | None = None


class GaAudioInput(Strict):
    format: GaFormat | None = None
    transcription: InputTranscription | None = None
    turn_detection: ServerVad | None = None
    noise_reduction: None = None


class GaAudio(Strict):
    input: GaAudioInput | None = None


class GaSession(Strict):
    """`session.update`'s session, as the GA API shapes a transcription session."""

    type: Literal["transcription"]
    audio: GaAudio | None = None
    include: list[Literal["item.input_audio_transcription.logprobs"]] | None = Field(None, max_length=0)


class TranscriptionSessionUpdate(Strict):
    type: Literal["transcription_session.update"]
    event_id: Text | None = None
    session: BetaSession


class SessionUpdate(Strict):
    type: Literal["session.update"]
    event_id: Text | None = None
    session: GaSession


class AudioAppend(Strict):
    type: Literal["input_audio_buffer.append"]
    event_id: Text | None = None
    audio: str = Field(description="Base64 of the audio, in the session's input format")


class AudioCommit(Strict):
    type: Literal["input_audio_buffer.commit"]
    event_id: Text | None = None


class AudioClear(Strict):
    type: Literal["input_audio_buffer.clear"]
    event_id: Text | None = None


ClientEvent = Annotated[
    TranscriptionSessionUpdate | SessionUpdate | AudioAppend | AudioCommit | AudioClear, Field(discriminator="type")
]
