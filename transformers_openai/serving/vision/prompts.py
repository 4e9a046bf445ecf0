"""A vision-language model's chat prompts: images loaded and checked, then rendered and processed by its processor."""

from __future__ import annotations

import asyncio
import copy
import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from transformers_openai.protocol.text import ChatMessage, ImagePart
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.template_variables import RENDERING_ARGUMENTS
from transformers_openai.serving.vision.fetch import MediaFetcher
from transformers_openai.serving.vision.images import DATA_PREFIX, data_url_bytes, decode_image, image_digest
from transformers_openai.serving.vision.limits import ImageLimits

# Processors' outputs the engine takes as the prompt itself, not as inputs for the image encoder.
_TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids"})
DEFAULT_WORKERS = 2


@dataclass(frozen=True)
class _Source:
    """One image part: where it stands in the request (`param`), and its bytes or its data URL (decoded in the pool)."""

    param: str
    data: bytes | str


class ProcessorPrompts:
    """`VisionPrompts` with the model's own processor (`AutoProcessor`).

    Image URLs are fetched on the event loop (asynchronously, under `limits`); base64 decoding, image decoding, the
    chat template and the processor run in a small pool of worker threads, each with its own copy of the processor
    (its fast tokenizer must not be shared across threads). A request's images are decoded by one task, so a hostile
    image holds one worker for as long as its bounded decoding takes and fails its own request only; text requests
    never wait for this pool.
    """

    def __init__(self, processor: Any, limits: ImageLimits, workers: int = DEFAULT_WORKERS) -> None:
        self.limits = limits
        self._fetcher = MediaFetcher(limits)
        tokenizer: Any = getattr(processor, "tokenizer", None)
        # The processor's own template, else its tokenizer's (what the checkpoint ships may sit in either).
        self._template: str | None = None
        if not getattr(processor, "chat_template", None) and getattr(tokenizer, "chat_template", None):
            self._template = str(tokenizer.get_chat_template())
        self.has_chat_template = bool(getattr(processor, "chat_template", None) or self._template)
        self._bos: str | None = getattr(tokenizer, "bos_token", None)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vision")
        self._copies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(workers):
            self._copies.put(copy.deepcopy(processor))

    async def encode_chat(
        self,
        messages: Sequence[Any],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], dict[str, Any]]:
        """The prompt's token ids, each image's placeholder tokens in place, and the processor's other outputs (CPU
        tensors) with `image_digest` (sha256 over the decoded images in order) and `images` (their count)."""
        if not self.has_chat_template:
            raise BadRequestError("this model has no chat template for messages with images", param="messages")
        chat = [ChatMessage.model_validate(m) if not isinstance(m, ChatMessage) else m for m in messages]
        sources = await self._sources(chat)
        rendered = [message.for_template(images=True) for message in chat]
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RENDERING_ARGUMENTS}
        kwargs.update(
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, rendered, sources, kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _sources(self, chat: list[ChatMessage]) -> list[_Source]:
        """Each image part's bytes (fetched) or data URL, in order; the count is checked over the whole request."""
        parts = [
            (f"messages.{i}.content.{j}", part.image_url.url)
            for i, message in enumerate(chat)
            if isinstance(message.content, list)
            for j, part in enumerate(message.content)
            if isinstance(part, ImagePart)
        ]
        if len(parts) > self.limits.max_images:
            raise BadRequestError(
                f"this request has {len(parts)} images, more than the {self.limits.max_images} allowed per request "
                "(--limit-mm-per-prompt)",
                param=parts[self.limits.max_images][0],
            )
        fetches = {
            index: asyncio.ensure_future(self._fetcher.fetch(url, param))
            for index, (param, url) in enumerate(parts)
            if not url.startswith(DATA_PREFIX)
        }
        try:
            if fetches:
                await asyncio.wait(fetches.values(), return_when=asyncio.FIRST_EXCEPTION)
        finally:  # the first failure (or the request's end) stops the other fetches
            for task in fetches.values():
                task.cancel()
            outcomes = await asyncio.gather(*fetches.values(), return_exceptions=True)
        failure = next((outcome for outcome in outcomes if isinstance(outcome, Exception)), None)
        if failure is not None:
            raise failure  # the first failed part's (the fetches it stopped end as cancelled, not as failures)
        fetched = {
            index: outcome for index, outcome in zip(fetches, outcomes, strict=True) if isinstance(outcome, bytes)
        }
        return [_Source(param, fetched.get(index, url)) for index, (param, url) in enumerate(parts)]

    def _encode(
        self, messages: list[dict[str, Any]], sources: list[_Source], kwargs: dict[str, Any]
    ) -> tuple[list[int], dict[str, Any]]:
        images = [self._decode(source) for source in sources]
        with self._own() as processor:
            try:
                text = processor.apply_chat_template(messages, chat_template=self._template, tokenize=False, **kwargs)
            except Exception as exc:  # template errors are the request's fault (e.g. role order, raise_exception)
                raise BadRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc
            # As transformers does: a template that writes the BOS itself gets no second one from the tokenizer.
            special = {"add_special_tokens": False} if self._bos and text.startswith(self._bos) else {}
            try:
                out = processor(text=[text], images=images or None, return_tensors="pt", **special)
            except Exception as exc:  # e.g. an image too small for the model's patches
                raise BadRequestError(
                    f"the model's processor could not take these images: {exc}", param="messages"
                ) from exc
        token_ids = [int(t) for t in out["input_ids"][0].tolist()]
        inputs: dict[str, Any] = {
            key: value.cpu() if isinstance(value, torch.Tensor) else value
            for key, value in out.items()
            if key not in _TOKEN_KEYS
        }
        inputs["image_digest"] = image_digest(images)
        inputs["images"] = len(images)
        return token_ids, inputs

    def _decode(self, source: _Source) -> Image.Image:
        data = source.data
        if isinstance(data, str):
            data = data_url_bytes(data, self.limits, source.param)
        return decode_image(data, self.limits, source.param)

    @contextmanager
    def _own(self) -> Iterator[Any]:
        processor = self._copies.get()
        try:
            yield processor
        finally:
            self._copies.put(processor)
