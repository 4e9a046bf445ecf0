"""The input items of a /v1/responses request: messages (text and image parts), a model's earlier thoughts and
function calls, and what the functions returned."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from transformers_openai.protocol.base import Text, Tolerant

TEXT_PARTS = ("input_text", "output_text")
MESSAGE_PARTS = (*TEXT_PARTS, "input_image")


class ContentText(Tolerant):
    """A text part of an input message: the user's `input_text`, or an earlier answer's `output_text`."""

    type: Literal["input_text", "output_text"]
    text: Text
    # What clients echo back of an earlier output_text part: accepted, not shown to the model.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def chat_part(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text}


_NO_FILE_ID = "'input_image' parts with a 'file_id' are not supported (there is no file store): send 'image_url'"
_NEEDS_URL = "an 'input_image' part needs 'image_url', a URL (a data: URL with the image in base64)"


class InputImage(Tolerant):
    """An image in an input message, as a URL (a `data:` URL, or one the server may fetch); the chat path reads it
    as an `image_url` part, and a model that reads no images refuses it there."""

    type: Literal["input_image"]
    image_url: Text | None = None
    file_id: Text | None = None
    # "original" (OpenAI's full resolution) is read as "high": the model's processor decides the resolution.
    detail: Literal["auto", "low", "high", "original"] | None = None

    @model_validator(mode="after")
    def _a_url(self) -> InputImage:
        if self.file_id is not None:
            raise ValueError(_NO_FILE_ID)
        if self.image_url is None:
            raise ValueError(_NEEDS_URL)
        return self

    def chat_part(self) -> dict[str, Any]:
        detail = "high" if self.detail == "original" else self.detail
        return {"type": "image_url", "image_url": {"url": self.image_url, "detail": detail}}


def parts_of(kinds: tuple[str, ...]) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in kinds:
                    names = " and ".join(repr(k) for k in kinds)
                    raise ValueError(f"content parts of type {kind!r} are not supported; only {names} parts are")
                if kind == "input_image":
                    _check_image(part)
        return value

    return check


def _check_image(part: dict[str, Any]) -> None:
    """Here, before the content's union is tried, so that the message says what is wrong with the image."""
    if part.get("file_id") is not None:
        raise ValueError(_NO_FILE_ID)
    if not isinstance(part.get("image_url"), str):
        raise ValueError(_NEEDS_URL)


def _joined(content: str | Sequence[ContentText | InputImage]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, ContentText))


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "image" if kind == "input_image" else "text"


MessagePart = Annotated[
    Annotated[ContentText, Tag("text")] | Annotated[InputImage, Tag("image")], Discriminator(_part_kind)
]


class MessageItem(Tolerant):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[MessagePart]
    id: Text | None = None
    status: Text | None = None
    phase: Text | None = None

    _known_parts = field_validator("content", mode="before")(parts_of(MESSAGE_PARTS))

    def text(self) -> str:
        return _joined(self.content)

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message holds it: the text, or its parts when it has images."""
        if isinstance(self.content, str) or not any(isinstance(p, InputImage) for p in self.content):
            return self.text()
        return [part.chat_part() for part in self.content]


class ReasoningText(Tolerant):
    type: Literal["reasoning_text"]
    text: Text


class SummaryText(Tolerant):
    type: Literal["summary_text"]
    text: Text


class ReasoningItem(Tolerant):
    """An earlier thought, given back with the conversation: shown to the chat template as the assistant message's
    `reasoning_content` (templates of reasoning models drop earlier thoughts themselves). `encrypted_content` is
    never produced here and cannot be read: it is accepted and not shown."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


class FunctionCallItem(Tolerant):
    """A call the model made, given back with the conversation."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(Tolerant):
    """What a called function returned."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentText]
    id: Text | None = None
    status: Text | None = None

    _text_parts = field_validator("output", mode="before")(parts_of(TEXT_PARTS))

    def text(self) -> str:
        return _joined(self.output)


def item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("type", "message"))  # an "easy" message has a role and no type
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(item_kind),
]
ITEM_KINDS = frozenset({"message", "function_call", "function_call_output", "reasoning"})
