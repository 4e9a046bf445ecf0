"""/tokenize and /detokenize in vLLM's shapes: routers and clients count tokens with them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from transformers_openai.protocol.base import Strict, Text
from transformers_openai.protocol.text import ChatMessage, TokenId, one_prompt_ending
from transformers_openai.protocol.tools import Tool


class TokenizeTextRequest(Strict):
    """A plain prompt, tokenized as /v1/completions would."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Strict):
    """Messages rendered by the chat template, tokenized as /v1/chat/completions would."""

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None  # the template's variables, as chat takes them

    _one_ending = field_validator("continue_final_message")(one_prompt_ending)


def _shape(body: Any) -> Literal["chat-request", "text-request"]:
    return "chat-request" if isinstance(body, dict) and "messages" in body else "text-request"


# The tags are no field names (not identifiers), so that an error names the field alone ('prompt', not 'text.prompt').
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("chat-request")] | Annotated[TokenizeTextRequest, Tag("text-request")],
    Discriminator(_shape),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
