"""Prompt rendering and tokenization off the event loop, and token strings for logprobs."""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import jinja2
import jinja2.meta
from transformers import PreTrainedTokenizerFast

from transformers_openai.engine.detokenizer import Decoder
from transformers_openai.serving.errors import BadRequestError

T = TypeVar("T")

# Prompts rendered and tokenized at once: each worker thread has its own copy of the tokenizer.
DEFAULT_WORKERS = 4


class _RustDecoder:
    """Decodes with the Rust tokenizer itself: what transformers' `decode` returns for a plain fast tokenizer without
    its Python around each call (twice per token per row: a visible share of a large batch's step)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text


def engine_decoder(tokenizer: Any) -> Decoder:
    """The engine thread's own decoder (a fast tokenizer must not be shared across threads): the Rust tokenizer's
    decode where transformers' would return the same text (a fast tokenizer whose class does not change decoding and
    that does not clean up spaces), else a copy of the tokenizer."""
    own = copy.deepcopy(tokenizer)
    plain = (
        isinstance(own, PreTrainedTokenizerFast)
        and type(own).decode is PreTrainedTokenizerFast.decode
        and type(own)._decode is PreTrainedTokenizerFast._decode
        and not own.clean_up_tokenization_spaces
    )
    return _RustDecoder(own._tokenizer) if plain else cast(Decoder, own)  # HF's decode is typed looser than ours


class TokenizerService:
    """Wraps a transformers tokenizer for the handlers.

    Rendering and encoding run in a small pool of worker threads, each task with a copy of the tokenizer of its
    own (a fast tokenizer must not be used from two threads at once): a long chat being rendered never blocks the
    event loop, nor the prompts of other requests, which go to the other workers. The copies are made here, at
    start-up: a copy made later would hold the GIL for a tenth of a second while streams run.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None, workers: int = DEFAULT_WORKERS) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()  # the original tokenizer: for markers and decode_now
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.vocab_size = len(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._copies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(workers):
            self._copies.put(copy.deepcopy(tokenizer))
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

    def response_template(self) -> Any:
        """The tokenizer's `response_template` (how its model's replies are parsed, read by `parse_response`); None
        when it has none."""
        return getattr(self._tokenizer, "response_template", None)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat rendered by its template and tokenized: by default ending in the assistant's header.

        `template_kwargs`: the template's own variables (`enable_thinking`, `reasoning_effort`, ...), checked by the
        caller not to collide with `apply_chat_template`'s arguments."""
        if not self.has_chat_template:
            raise BadRequestError(
                "this model has no chat template; start the server with --chat-template FILE or use /v1/completions",
                param="messages",
            )
        ending = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        return await self._in_pool(self._render_chat, messages, tools, {**(template_kwargs or {}), **ending})

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._in_pool(self._encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._in_pool(self._decode, token_ids)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary writes it (byte-level pieces included, e.g. 'Ġthe')."""
        return await self._in_pool(self._token_strings, token_ids)

    async def encode_texts(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids of each text with the model's special tokens; with `max_length`, cut to it as the tokenizer
        truncates (its special tokens kept)."""
        return await self._in_pool(self._encode_many, texts, max_length)

    async def encode_pairs(
        self, firsts: list[str], seconds: list[str], max_length: int | None = None
    ) -> list[tuple[list[int], list[int] | None]]:
        """Each (first, second) pair tokenized together as a cross-encoder reads it: the ids with the model's special
        tokens, and the token types where the tokenizer makes them; with `max_length`, cut to it as the tokenizer
        truncates a pair (from the longer of the two)."""
        return await self._in_pool(self._encode_pairs, firsts, seconds, max_length)

    def longest_token_chars(self) -> int:
        """The most characters one token of the vocabulary decodes to (bounds how few tokens a text can take)."""
        with self._lock:
            tokens = self._tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
            return max((len(self._tokenizer.convert_tokens_to_string([t])) for t in tokens if t), default=1)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @contextmanager
    def _own(self) -> Iterator[Any]:
        """A copy of the tokenizer no other thread uses meanwhile (there is one per worker)."""
        tokenizer = self._copies.get()
        try:
            yield tokenizer
        finally:
            self._copies.put(tokenizer)

    def token_text(self, token_id: int) -> str:
        """A token's text, for logprobs; call it from the event loop only."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self._single.decode([token_id], skip_special_tokens=False))
        return text

    def _render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, variables: dict[str, Any]
    ) -> list[int]:
        with self._own() as tokenizer:
            try:
                text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **variables)
            except Exception as exc:  # template errors are the request's fault (e.g. role order)
                message = f"the chat template rejected these messages: {exc}"
                raise BadRequestError(message, param="messages") from exc
            return list(tokenizer.encode(text, add_special_tokens=False))

    def decoder_copy(self) -> Decoder:
        """A decoder for one thread's own use (e.g. the event loop's, for text streamed token by token); make it
        once, at start-up: a copy takes a while and holds the GIL meanwhile."""
        return engine_decoder(self._tokenizer)

    def decode_now(self, token_ids: list[int]) -> str:
        """Decodes on the calling thread (one that may block: not the event loop), with the original tokenizer: it
        takes no worker's copy away from the prompts being rendered."""
        with self._lock:
            return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._own() as tokenizer:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _token_strings(self, token_ids: list[int]) -> list[str]:
        with self._own() as tokenizer:
            return [str(token) for token in tokenizer.convert_ids_to_tokens(token_ids)]

    def _encode_many(self, texts: list[str], max_length: int | None) -> list[list[int]]:
        with self._own() as tokenizer:
            cut = {"truncation": True, "max_length": max_length} if max_length is not None else {}
            return [list(ids) for ids in tokenizer(texts, **cut)["input_ids"]]

    def _encode_pairs(
        self, firsts: list[str], seconds: list[str], max_length: int | None
    ) -> list[tuple[list[int], list[int] | None]]:
        with self._own() as tokenizer:
            cut = {"truncation": True, "max_length": max_length} if max_length is not None else {}
            encoded = tokenizer(firsts, seconds, **cut)
            types = encoded.get("token_type_ids") or [None] * len(firsts)
            pairs = zip(encoded["input_ids"], types, strict=True)
            return [(list(ids), None if kinds is None else list(kinds)) for ids, kinds in pairs]

    def _decode(self, token_ids: list[int]) -> str:
        with self._own() as tokenizer:
            return str(tokenizer.decode(token_ids, skip_special_tokens=False))
