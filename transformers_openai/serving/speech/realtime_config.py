"""A realtime transcription session's settings: updated from either session shape, shown back in the shape asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers_openai.protocol.realtime import (
    GA_FORMATS,
    SAMPLE_RATES,
    AudioFormat,
    BetaSession,
    GaSession,
    ServerVad,
)


def requested_model(session: BetaSession | GaSession) -> str | None:
    """The transcription model a session update names, if it names one."""
    if isinstance(session, BetaSession):
        transcription = session.input_audio_transcription
    else:
        audio_input = session.audio.input if session.audio is not None else None
        transcription = audio_input.transcription if audio_input is not None else None
    return transcription.model if transcription is not None else None


@dataclass
class SessionConfig:
    model: str
    audio_format: AudioFormat = "pcm16"
    language: str | None = None
    prompt: str | None = None
    vad: ServerVad | None = field(default_factory=ServerVad)  # None: the client commits each turn

    @property
    def sampling_rate(self) -> int:
        return SAMPLE_RATES[self.audio_format]

    def update_beta(self, session: BetaSession) -> None:
        if session.input_audio_format is not None:
            self.audio_format = session.input_audio_format
        if session.input_audio_transcription is not None:
            self._transcription(session.input_audio_transcription.model_dump(exclude_unset=True))
        if "turn_detection" in session.model_fields_set:
            self.vad = session.turn_detection

    def update_ga(self, session: GaSession) -> None:
        audio_input = session.audio.input if session.audio is not None else None
        if audio_input is None:
            return
        if audio_input.format is not None:
            self.audio_format = GA_FORMATS[audio_input.format.type]
        if audio_input.transcription is not None:
            self._transcription(audio_input.transcription.model_dump(exclude_unset=True))
        if "turn_detection" in audio_input.model_fields_set:
            self.vad = audio_input.turn_detection

    def _transcription(self, fields: dict[str, Any]) -> None:
        if fields.get("model") is not None:
            self.model = fields["model"]
        if "language" in fields:
            self.language = fields["language"] or None
        if "prompt" in fields:
            self.prompt = fields["prompt"] or None

    def _transcription_view(self) -> dict[str, Any]:
        return {"model": self.model, "language": self.language, "prompt": self.prompt}

    def _vad_view(self) -> dict[str, Any] | None:
        return None if self.vad is None else self.vad.model_dump(exclude_none=True)

    def beta_view(self, session_id: str) -> dict[str, Any]:
        return {
            "id": session_id,
            "object": "realtime.transcription_session",
            "input_audio_format": self.audio_format,
            "input_audio_transcription": self._transcription_view(),
            "turn_detection": self._vad_view(),
            "input_audio_noise_reduction": None,
            "include": None,
        }

    def ga_view(self, session_id: str) -> dict[str, Any]:
        kind = next(name for name, value in GA_FORMATS.items() if value == self.audio_format)
        audio_format: dict[str, Any] = {"type": kind}
        if self.audio_format == "pcm16":
            audio_format["rate"] = self.sampling_rate
        return {
            "type": "transcription",
            "id": session_id,
            "object": "realtime.transcription_session",
            "audio": {
                "input": {
                    "format": audio_format,
                    "transcription": self._transcription_view(),
                    "turn_detection": self._vad_view(),
                    "noise_reduction": None,
                }
            },
            "include": None,
        }
