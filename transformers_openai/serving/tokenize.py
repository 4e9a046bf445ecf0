"""POST /tokenize and /detokenize: the prompt's tokens exactly as generation would see them, and back."""

from __future__ import annotations

from typing import Any

from transformers_openai.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeResponse,
    TokenizeTextRequest,
)
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.chat_tools import ChatTools
from transformers_openai.serving.text.template_variables import template_variables


class TokenizeHandler:
    """Counts and lists tokens with the served tokenizer; `tools` renders offered tools as chat does (None for a model
    without chat)."""

    endpoint = "tokenize"

    def __init__(self, ctx: ServingContext, tools: ChatTools | None) -> None:
        self.ctx = ctx
        self._tools = tools

    async def tokenize(self, request: TokenizeTextRequest | TokenizeChatRequest) -> TokenizeResponse:
        self._check_model(request.model)
        tokenizer = self.ctx.tokenizer
        if isinstance(request, TokenizeTextRequest):
            ids = await tokenizer.encode_text(request.prompt, request.add_special_tokens)
        else:
            tools = None
            if request.tools:
                if self._tools is None:
                    raise BadRequestError("this model does not call tools", param="tools")
                tools = self._tools.template_tools(request.tools)
            ending = (request.add_generation_prompt, request.continue_final_message)
            variables = self._variables(request)
            if any(message.images() for message in request.messages):
                ids = await self._image_prompt(request, tools, ending, variables)
            else:
                messages = [message.for_template() for message in request.messages]
                ids = await tokenizer.encode_chat(messages, tools, *ending, template_kwargs=variables)
        strings = await tokenizer.token_strings(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids, token_strs=strings)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request.model)
        vocab = self.ctx.tokenizer.vocab_size
        unknown = [token for token in request.tokens if token >= vocab]
        if unknown:
            raise BadRequestError(
                f"token id {unknown[0]} is not in the vocabulary (ids go from 0 to {vocab - 1})", param="tokens"
            )
        return DetokenizeResponse(prompt=await self.ctx.tokenizer.decode(list(request.tokens)))

    async def _image_prompt(
        self,
        request: TokenizeChatRequest,
        tools: list[dict[str, Any]] | None,
        ending: tuple[bool, bool],
        variables: dict[str, Any],
    ) -> list[int]:
        """A chat with images, as a vision-language model's processor renders it: each image's tokens counted."""
        ids, _ = await self.ctx.image_prompts().encode_chat(request.messages, tools, *ending, template_kwargs=variables)
        return ids

    def _variables(self, request: TokenizeChatRequest) -> dict[str, Any]:
        """The template's variables as chat renders with them (its checks and 400s): the server's defaults, then the
        request's own."""
        return template_variables(self.ctx.default_template_kwargs, request.chat_template_kwargs)

    def _check_model(self, model: str | None) -> None:
        if model is not None:  # optional here, as in vLLM
            self.ctx.check_model(model)
