"""What chat and completions share: ids, limits, fan-out over n and prompts, streaming, usage, disconnects."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from transformers_openai.engine.request import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    RequestOutput,
    TokenConstraint,
    TokenLogprob,
)
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.protocol import ChatCompletionRequest, CompletionRequest, CompletionTokensDetails, Usage
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.disconnect import ClientDisconnected, WaitDisconnect, until_disconnect
from transformers_openai.serving.errors import (
    BadRequestError,
    InternalServerError,
    RequestTimeoutError,
    ServiceUnavailableError,
    to_openai_error,
)
from transformers_openai.serving.text.reasoning import ReasoningSplitter
from transformers_openai.serving.text.tool_parser import ToolCallParser

logger = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)
__all__ = ["ClientDisconnected", "GenerationHandler", "WaitDisconnect", "check_output"]


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the prompt as text, when echo needs it
    # A decoder-only model's other inputs (a vision-language model's images, as its processor prepared them).
    encoder_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Choice:
    """The accumulated state of one choice (one engine request)."""

    index: int
    prompt: Prompt
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when the prompt was scored
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it
    completion_tokens: int = 0
    tool_parser: ToolCallParser | None = None  # a stream's tool calls, read as they come
    # Where the model's thought is told from its answer: the splitter, the two parts so far, the last output's.
    splitter: ReasoningSplitter | None = None
    reasoning: str = ""
    answer: str = ""
    last_split: tuple[str, str] = ("", "")
    reasoning_sent: bool = False  # a stream that holds the thought back has sent it

    def split(self, output: RequestOutput) -> None:
        """Feeds the splitter one output (and, when it is the last, flushes it)."""
        if self.splitter is None:
            return
        reasoning, answer = self.splitter.feed(output.text, len(output.token_ids))
        if output.finished:
            more_reasoning, more_answer = self.splitter.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        self.reasoning += reasoning
        self.answer += answer
        self.last_split = (reasoning, answer)


@dataclass(frozen=True)
class AnswerGrammar:
    """What the answer must follow, token by token: a JSON schema or a Lark grammar."""

    param: str  # the request field that asked for it, named in a 400
    schema: dict[str, Any] | None = None
    lark: str | None = None
    what: str = ""  # what the request gave, as a 400 names it ("the regex"); empty: "the grammar"


class GenerationHandler(Generic[RequestT]):
    """Base of the chat and completions handlers; subclasses build prompts and shape the responses."""

    request_id_prefix = "req-"  # of the response's `id`: chatcmpl-, cmpl-
    endpoint = ""  # its name in the metrics
    default_max_tokens_when_unset: int | None = None  # None: the rest of the context

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # -- subclass hooks
    async def prompts(self, request: RequestT) -> list[Prompt]:
        raise NotImplementedError

    def response(self, request_id: str, request: RequestT, choices: list[Choice], usage: Usage) -> BaseModel:
        raise NotImplementedError

    def first_chunks(self, request_id: str, request: RequestT, choices: list[Choice]) -> list[BaseModel]:
        return []

    def chunk(
        self, request_id: str, request: RequestT, choice: Choice, output: RequestOutput, usage: Usage | None
    ) -> BaseModel | None:
        """The chunk for one engine output (None when it adds nothing); `usage` so far when asked for."""
        raise NotImplementedError

    def usage_chunk(self, request_id: str, request: RequestT, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def answer_grammar(self, request: RequestT, prompts: list[Prompt]) -> AnswerGrammar | None:
        """What the answer must follow (structured outputs, forced tool calls), if the request says; `prompts` are
        the rendered prompts (whether the model starts in a thought can change the grammar)."""
        return None

    def prepare_choices(self, request: RequestT, choices: list[Choice]) -> None:
        """Sets up each choice's state before its outputs come (chat: the reasoning splitter)."""

    def sampling_params(self, request: RequestT, max_tokens: int) -> SamplingParams:
        return request.to_sampling_params(max_tokens)

    # -- the shared flow
    async def create(
        self, request: RequestT, wait_disconnect: WaitDisconnect, request_id: str | None = None
    ) -> BaseModel | AsyncIterator[BaseModel]:
        """Validates, submits to the engine and returns a full response or a stream of chunks.

        `request_id` (the X-Request-Id) names the engine requests (`<id>-<choice>`) and their log lines.
        """
        self.ctx.check_model(request.model)
        if request.prompt_logprobs is not None and self.ctx.encoder_decoder:
            message = "an encoder-decoder model reads the prompt with its encoder: it cannot score it"
            raise BadRequestError(message, param="prompt_logprobs")
        base_id = request_id or uuid.uuid4().hex
        created = int(time.time())
        prompts = await self.prompts(request)
        constraints = await self._constraints(request, prompts, len(prompts) * request.n)
        choices, engine_requests = self._fan_out(base_id, request, prompts, constraints)
        self.prepare_choices(request, choices)
        request_id = self.request_id_prefix + base_id
        streams = self.ctx.engine.submit(engine_requests)
        merged = self._merge([r.request_id for r in engine_requests], streams)
        if request.stream:
            return self._stream(request_id, request, choices, merged, created)
        return await self._collect_or_abort(request_id, request, choices, merged, wait_disconnect, created)

    async def _constraints(self, request: RequestT, prompts: list[Prompt], count: int) -> list[TokenConstraint] | None:
        """One grammar constraint per choice when the answer must follow a grammar, built in a worker thread (and
        a grammar the request gives converted there too: GBNF's converter is Python, tens of ms for a large one)."""
        if request.output_constraints():
            grammar = await asyncio.to_thread(self.answer_grammar, request, prompts)
        else:
            grammar = self.answer_grammar(request, prompts)
        if grammar is None:
            return None
        structured = self.ctx.structured
        if structured is None:
            raise BadRequestError("structured outputs are not available for this model", param=grammar.param)
        if grammar.lark is not None:
            lark = grammar.lark
            build = structured.lark_constraints
            return list(await asyncio.to_thread(build, lark, count, grammar.param, grammar.what or "the grammar"))
        schema = grammar.schema or {}
        return list(await asyncio.to_thread(structured.constraints, schema, count, grammar.param))

    def _fan_out(
        self, base_id: str, request: RequestT, prompts: list[Prompt], constraints: list[TokenConstraint] | None = None
    ) -> tuple[list[Choice], list[EngineRequest]]:
        choices: list[Choice] = []
        engine_requests: list[EngineRequest] = []
        lora = self.ctx.adapter(request.model)  # the adapter it names, held by its engine requests
        if lora is None:
            self.ctx.check_model(request.model)  # an adapter unloaded since the request came: a 404 still
        for p, prompt in enumerate(prompts):
            max_tokens = self._max_tokens(request, len(prompt.token_ids))
            params = self.sampling_params(request, max_tokens)
            self._check_vocab(params, prompt.token_ids)
            for i in range(request.n):
                index = p * request.n + i
                seed = None if params.seed is None else params.seed + i
                choice_params = params if seed == params.seed else replace(params, seed=seed)
                choices.append(Choice(index=index, prompt=prompt))
                constraint = constraints[index] if constraints else None
                engine_request = self._engine_request(f"{base_id}-{index}", prompt, choice_params, constraint)
                engine_requests.append(replace(engine_request, priority=request.priority, lora=lora))
        return choices, engine_requests

    def _engine_request(
        self, engine_id: str, prompt: Prompt, params: SamplingParams, constraint: TokenConstraint | None = None
    ) -> EngineRequest:
        """An encoder-decoder model reads the prompt with its encoder; a decoder-only model continues it."""
        if self.ctx.encoder_decoder:
            inputs = {"input_ids": prompt.token_ids}
            return EngineRequest(engine_id, [], params, encoder_inputs=inputs, constraint=constraint)
        return EngineRequest(
            engine_id, prompt.token_ids, params, encoder_inputs=prompt.encoder_inputs, constraint=constraint
        )

    def _max_tokens(self, request: RequestT, prompt_len: int) -> int:
        limit = self.ctx.max_model_len
        room = limit - prompt_len
        if prompt_len == 0:
            raise BadRequestError("the prompt is empty", param="prompt")
        if self.ctx.max_input_len is not None:  # encoder-decoder: input and output have separate limits
            if prompt_len > self.ctx.max_input_len:
                raise BadRequestError(
                    f"the input is {prompt_len} tokens long but the model's encoder takes at most "
                    f"{self.ctx.max_input_len}; shorten it",
                    param=_prompt_param(request),
                    code="context_length_exceeded",
                )
            room = limit
        if room < 1:
            raise BadRequestError(
                f"the prompt is {prompt_len} tokens long but the model's context is {limit} tokens; shorten the prompt",
                param=_prompt_param(request),
                code="context_length_exceeded",
            )
        requested = request.requested_max_tokens()
        if requested is None:
            default = self.ctx.default_max_tokens or self.default_max_tokens_when_unset or room
            return min(default, room)
        if requested > room:
            raise BadRequestError(
                f"this model's context is {limit} tokens and at most {room} can be generated for this prompt "
                f"({prompt_len} tokens), but {requested} were asked for; lower max_tokens or shorten the prompt",
                param=_max_tokens_param(request),
                code="context_length_exceeded",
            )
        return requested

    def _check_vocab(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        """Every number that becomes a token id or a tensor size is bounded by the vocabulary, here at the edge."""
        vocab = self.ctx.tokenizer.vocab_size
        for token_id in params.logit_bias:
            if not 0 <= token_id < vocab:
                raise BadRequestError(f"logit_bias token id {token_id} is outside the vocabulary", param="logit_bias")
        if params.top_k > vocab:
            raise BadRequestError(f"top_k must be at most the vocabulary size ({vocab}) or -1", param="top_k")
        check_token_ids(prompt_ids, vocab)

    async def _merge(
        self, engine_ids: list[str], streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleaves the choices' outputs as they come; aborts every unfinished one on exit."""
        if len(streams) == 1:
            try:
                async for output in streams[0]:
                    yield 0, output
            finally:
                self.ctx.engine.abort(engine_ids[0])
            return
        # Bounded: when the client stops reading, the pumps stop taking outputs too, so the engine's flow control
        # sees each choice's outputs pile up and pauses its row.
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue(maxsize=len(streams))

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for output in stream:
                    await queue.put((index, output))
            except Exception as exc:
                await queue.put((index, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield index, item
                remaining -= item.finished
        finally:
            # Abort first: the awaits below may themselves be cancelled when the client is gone.
            for engine_id in engine_ids:
                self.ctx.engine.abort(engine_id)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect_or_abort(
        self,
        request_id: str,
        request: RequestT,
        choices: list[Choice],
        merged: AsyncIterator[tuple[int, RequestOutput]],
        wait_disconnect: WaitDisconnect,
        created: int,
    ) -> BaseModel:
        await until_disconnect(self._collect(choices, merged), wait_disconnect, request_id)
        return _created_at(self.response(request_id, request, choices, self._usage(choices)), created)

    async def _collect(self, choices: list[Choice], merged: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        try:
            async for index, output in merged:
                check_output(output)
                self._accumulate(choices[index], output)
        finally:
            await merged.aclose()  # type: ignore[attr-defined]

    async def _stream(
        self,
        request_id: str,
        request: RequestT,
        choices: list[Choice],
        merged: AsyncIterator[tuple[int, RequestOutput]],
        created: int,
    ) -> AsyncIterator[BaseModel]:
        try:
            for chunk in self.first_chunks(request_id, request, choices):
                yield _created_at(chunk, created)
            async for index, output in merged:
                check_output(output)
                choice = choices[index]
                self._accumulate(choice, output)
                usage = self._usage(choices) if request.continuous_usage() else None
                delta = self.chunk(request_id, request, choice, output, usage)
                if delta is not None:
                    yield _created_at(delta, created)
            if request.include_usage():
                yield _created_at(self.usage_chunk(request_id, request, self._usage(choices)), created)
        finally:  # also when the client is gone (the SSE helper logs why): aborts what is unfinished
            await merged.aclose()  # type: ignore[attr-defined]

    @staticmethod
    def _accumulate(choice: Choice, output: RequestOutput) -> None:
        choice.text += output.text
        choice.token_ids.extend(output.token_ids)
        if output.logprobs:
            choice.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs
        choice.completion_tokens = output.completion_tokens
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason.value
            choice.stop_string = output.stop_string
        choice.split(output)

    @staticmethod
    def _usage(choices: list[Choice]) -> Usage:
        prompt_tokens = sum(len(p.token_ids) for p in {id(c.prompt): c.prompt for c in choices}.values())
        completion_tokens = sum(c.completion_tokens for c in choices)
        splitters = [c.splitter for c in choices if c.splitter is not None]
        details = CompletionTokensDetails(reasoning_tokens=sum(s.reasoning_tokens for s in splitters))
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            completion_tokens_details=details if splitters else None,
        )


def _created_at(body: BaseModel, created: int) -> BaseModel:
    """Every chunk of a response, and the response, carry the one `created` of its request (OpenAI's)."""
    if "created" in type(body).model_fields:
        body.created = created  # type: ignore[attr-defined]
    return body


def check_token_ids(token_ids: list[int], vocab: int) -> None:
    if any(not 0 <= t < vocab for t in token_ids):
        raise BadRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")


def _prompt_param(request: ChatCompletionRequest | CompletionRequest) -> str:
    return "messages" if isinstance(request, ChatCompletionRequest) else "prompt"


def _max_tokens_param(request: ChatCompletionRequest | CompletionRequest) -> str:
    """The field that set the limit: chat's max_completion_tokens wins over max_tokens."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def check_output(output: RequestOutput) -> None:
    if output.finish_reason is FinishReason.ERROR and output.error_kind is ErrorKind.SHUTDOWN:
        raise ServiceUnavailableError(output.error or "the server is shutting down")
    if output.finish_reason is FinishReason.ERROR and output.error_kind is ErrorKind.STALLED:
        raise RequestTimeoutError(output.error or "the client stopped reading the response")
    if output.finish_reason is FinishReason.ERROR and output.error_kind is ErrorKind.CONSTRAINT:
        raise BadRequestError(output.error or "the answer's grammar failed", code="grammar_failed")
    if output.finish_reason is FinishReason.ERROR:
        raise InternalServerError(f"generation failed: {output.error}")
    if output.finish_reason is FinishReason.ABORT:
        raise to_openai_error(RuntimeError("request aborted"))
