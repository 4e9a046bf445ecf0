"""Prompt rendering and tokenization off the event loop, and token strings for logprobs."""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import jinja2
import jinja2.meta

from transformers_openai.serving.errors import BadRequestError


class TokenizerService:
    """Wraps a transformers tokenizer for the handlers.

    Encoding runs in a worker thread under a lock: a fast tokenizer must not be used from two
    threads at once, and rendering a long chat must not block the event loop.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.vocab_size = len(tokenizer)
        # Single tokens' texts (logprobs) are looked up on the event loop: from a copy of the tokenizer only that
        # thread uses, so no lookup waits for the lock a long chat rendering holds, and each token decoded once.
        self._single = copy.deepcopy(tokenizer)
        self._token_texts: dict[int, str] = {}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def template_source(self, with_tools: bool = False) -> str:
        """The chat template's text (the one for tool use, where a model has several); empty when there is none."""
        if not self.has_chat_template:
            return ""
        try:
            return str(self._tokenizer.get_chat_template(tools=[{}] if with_tools else None))
        except ValueError:  # several named templates and none is the default
            return ""

    def takes_tools(self) -> bool:
        """Whether the chat template shows the model the tools it is given."""
        source = self.template_source(with_tools=True)
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
        except jinja2.TemplateError:  # tags of transformers' own (e.g. {% generation %}): read the text
            return "tools" in source

    def added_token(self, text: str) -> tuple[int, bool] | None:
        """The id of the added token that is all of `text` (a marker), and whether it is special; None if none is."""
        with self._lock:
            for token_id, token in self._tokenizer.added_tokens_decoder.items():
                if token.content == text:
                    return int(token_id), bool(token.special)
        return None

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not self.has_chat_template:
            raise BadRequestError(
                "this model has no chat template; start the server with --chat-template FILE "
                "or use /v1/completions",
                param="messages",
            )
        return await asyncio.to_thread(self._render_chat, messages, tools)

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.to_thread(self._encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await asyncio.to_thread(self._decode, token_ids)

    def token_text(self, token_id: int) -> str:
        """A token's text, for logprobs; call it from the event loop only."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self._single.decode([token_id], skip_special_tokens=False))
        return text

    def _render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        with self._lock:
            try:
                text = self._tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # template errors are the request's fault (e.g. role order)
                raise BadRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode_now(self, token_ids: list[int]) -> str:
        """Decodes on the calling thread (one that may block: not the event loop)."""
        return self._decode(token_ids)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _decode(self, token_ids: list[int]) -> str:
        with self._lock:
            return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))
