"""/v1/audio/transcriptions and /v1/audio/translations: multipart forms in, the five formats or SSE events out."""

from __future__ import annotations

import io
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, Response, UploadFile

from transformers_openai.api.model_pick import model_handlers, model_metrics
from transformers_openai.api.openapi import error_responses
from transformers_openai.api.routes import respond
from transformers_openai.protocol.audio import (
    Granularity,
    ResponseFormat,
    Task,
    Transcription,
    TranscriptionRequest,
    TranscriptionVerbose,
)
from transformers_openai.serving.errors import BadRequestError, PayloadTooLargeError
from transformers_openai.serving.speech.transcript_formats import MEDIA_TYPES

_TEXT_FORMATS = {media.split(";")[0]: {"schema": {"type": "string"}} for media in MEDIA_TYPES.values()}
_TEXT_FORMATS["text/event-stream"] = {"schema": {"type": "string", "description": "transcript.text.* events"}}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": Transcription | TranscriptionVerbose,
        "description": "json or verbose_json; text, srt and vtt as plain text; with stream=true, "
        "`transcript.text.delta` events, `transcript.text.segment` for srt/vtt, then `transcript.text.done`",
        "content": _TEXT_FORMATS,
    },
    **error_responses(400, 401, 404, 408, 413, 429, 503),
}

FileField = Annotated[UploadFile, File(description="The audio: wav, flac, mp3, ogg/opus, webm, m4a, ...")]
ModelField = Annotated[str, Form(description="The served model's id")]
PromptField = Annotated[str | None, Form(description="Text to condition the first window on (spelling, names)")]
FormatField = Annotated[ResponseFormat, Form()]
TemperatureField = Annotated[
    float | None,
    Form(
        ge=0.0,
        le=1.0,
        description="Not given: greedy, a rejected window retried at 0.2, 0.4, ... 1.0 (streams per window); "
        "given: this temperature alone, no retries (streams token by token)",
    ),
]


def build_audio_router() -> APIRouter:
    router = APIRouter()

    @router.post("/audio/transcriptions", responses=_RESPONSES, response_model=None)
    async def transcriptions(
        request: Request,
        file: FileField,
        model: ModelField,
        language: Annotated[str | None, Form(description="ISO-639-1 code of the audio's language")] = None,
        prompt: PromptField = None,
        response_format: FormatField = "json",
        temperature: TemperatureField = None,
        granularities: Annotated[list[Granularity] | None, Form(alias="timestamp_granularities[]")] = None,
        granularities_plain: Annotated[list[Granularity] | None, Form(alias="timestamp_granularities")] = None,
        stream: Annotated[bool, Form(description="Send text as it is decoded (Server-Sent Events)")] = False,
    ) -> Response:
        asked = frozenset([*(granularities or ()), *(granularities_plain or ())])
        if asked and response_format != "verbose_json":
            raise BadRequestError(
                "timestamp_granularities needs response_format 'verbose_json'", param="timestamp_granularities"
            )
        fields = dict(language=language, granularities=asked, stream=stream)
        return await _serve(request, "transcribe", file, model, prompt, response_format, temperature, fields)

    @router.post("/audio/translations", responses=_RESPONSES, response_model=None)
    async def translations(
        request: Request,
        file: FileField,
        model: ModelField,
        prompt: PromptField = None,
        response_format: FormatField = "json",
        temperature: TemperatureField = None,
    ) -> Response:
        return await _serve(request, "translate", file, model, prompt, response_format, temperature, {})

    return router


async def _serve(
    request: Request,
    task: Task,
    file: UploadFile,
    model: str,
    prompt: str | None,
    response_format: ResponseFormat,
    temperature: float | None,
    fields: dict[str, Any],
) -> Response:
    app = request.app
    handler = (await model_handlers(request, model)).transcriptions
    model_metrics(request).on_request("translations" if task == "translate" else "transcriptions")
    try:
        _check_size(file, app.state.settings.max_audio_bytes)
        body = TranscriptionRequest(
            audio=file.file,  # decoded from where the upload was spooled (memory, or disk past 1 MB): not copied
            filename=file.filename or "",
            model=model,
            task=task,
            prompt=prompt,
            response_format=response_format,
            temperature=0.0 if temperature is None else temperature,
            fallback=temperature is None,
            **fields,
        )
        # The handler has decoded the file by the time it answers, even with a stream of events.
        return await respond(
            request, lambda wait, request_id: handler.create(body, wait, request_id), MEDIA_TYPES[response_format]
        )
    finally:
        await file.close()


def _check_size(file: UploadFile, limit: int) -> None:
    size = file.size
    if size is None:
        size = file.file.seek(0, io.SEEK_END)
        file.file.seek(0)
    if size > limit:
        raise _too_large(limit)


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the audio file is larger than this server's limit of {limit} bytes")
