"""POST /v1/chat/completions: messages through the chat template, answers as chat completions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from transformers_openai.engine.request import RequestOutput, TokenLogprob
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    DeltaToolCall,
    PromptLogprobs,
    TopLogprob,
    Usage,
)
from transformers_openai.serving.base import AnswerGrammar, Choice, GenerationHandler, Prompt
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.chat_tools import ChatTools, delta_parts, tool_calls
from transformers_openai.serving.text.output_constraints import answer_grammar_of
from transformers_openai.serving.text.prompt_scores import prompt_logprobs
from transformers_openai.serving.text.reasoning import ReasoningFormat, reasoning_format
from transformers_openai.serving.text.template_variables import template_variables
from transformers_openai.serving.text.thought_grammar import after_thought
from transformers_openai.serving.text.tool_parser import ToolCallParser, parse_answer


class ChatHandler(GenerationHandler[ChatCompletionRequest]):
    request_id_prefix = "chatcmpl-"
    endpoint = "chat_completions"

    def __init__(self, ctx: ServingContext) -> None:
        super().__init__(ctx)
        self.tools = ChatTools(ctx.tokenizer, ctx.tool_format)
        self.reasoning = reasoning_format(ctx)  # how the model's thought is told from its answer; None: it is not

    def reasoning_of(self, request: ChatCompletionRequest) -> ReasoningFormat | None:
        """The reasoning format that splits this request's answers: none when it asks for no split."""
        return self.reasoning if request.separate_reasoning else None

    async def prompts(self, request: ChatCompletionRequest) -> list[Prompt]:
        ending = (request.add_generation_prompt, request.continue_final_message)
        variables = template_variables(
            self.ctx.default_template_kwargs, request.chat_template_kwargs, request.reasoning_effort
        )
        if any(m.images() for m in request.messages):
            return [await self._image_prompt(request, variables)]
        messages = [m.for_template() for m in request.messages]
        tokenizer = self.ctx.tokenizer
        if self.ctx.encoder_decoder and not tokenizer.has_chat_template and not request.offered_tools():
            # Seq2seq models are mostly prompted with plain text: the contents, one message per line.
            return [Prompt(await tokenizer.encode_text("\n".join(m["content"] for m in messages)))]
        tools = self.tools.template_tools(request.offered_tools())
        return [Prompt(await tokenizer.encode_chat(messages, tools, *ending, template_kwargs=variables))]

    async def _image_prompt(self, request: ChatCompletionRequest, variables: dict[str, Any]) -> Prompt:
        """A chat with images, rendered and tokenized by a vision-language model's processor."""
        tools = self.tools.template_tools(request.offered_tools())
        ending = (request.add_generation_prompt, request.continue_final_message)
        token_ids, inputs = await self.ctx.image_prompts().encode_chat(
            request.messages, tools, *ending, template_kwargs=variables
        )
        return Prompt(token_ids, encoder_inputs=inputs)

    def answer_grammar(self, request: ChatCompletionRequest, prompts: list[Prompt]) -> AnswerGrammar | None:
        grammar = self._answer_grammar(request)
        fmt = self.reasoning_of(request)
        if grammar is None or fmt is None:
            return grammar
        # The model thinks first (the prompt opened its thought), or may open one itself: the grammar follows it.
        opened = any(fmt.thinks_at_start(p.token_ids) for p in prompts)
        return after_thought(grammar, fmt, self.ctx.tokenizer, opened)

    def _answer_grammar(self, request: ChatCompletionRequest) -> AnswerGrammar | None:
        forced = self.tools.forced_grammar(request)
        constraints = request.output_constraints()
        if forced is None:
            return answer_grammar_of(constraints)
        if constraints:  # (response_format's is refused with the request)
            message = f"'{constraints[0].param}' cannot be combined with a tool_choice that forces a call"
            raise BadRequestError(message, param=constraints[0].param)
        return AnswerGrammar("tool_choice", lark=forced)

    def prepare_choices(self, request: ChatCompletionRequest, choices: list[Choice]) -> None:
        fmt = self.reasoning_of(request)
        if fmt is None:
            return
        thinking: dict[int, bool] = {}  # by prompt: the n choices of one prompt share it
        for choice in choices:
            key = id(choice.prompt)
            if key not in thinking:
                thinking[key] = fmt.thinks_at_start(choice.prompt.token_ids)
            choice.splitter = fmt.splitter(thinking[key])

    def sampling_params(self, request: ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        params = request.to_sampling_params(max_tokens)
        fmt = self.reasoning_of(request)
        if (request.offered_tools() and self.tools.keeps_markers) or (fmt is not None and fmt.keeps_markers):
            params = replace(params, skip_special_tokens=False)  # special markers must survive decoding to be seen
        return params

    def response(
        self, request_id: str, request: ChatCompletionRequest, choices: list[Choice], usage: Usage
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request_id,
            model=request.model,
            choices=[self._choice(request, c) for c in choices],
            usage=usage,
            prompt_logprobs=self._prompt_logprobs(request, choices),
        )

    def _choice(self, request: ChatCompletionRequest, choice: Choice) -> ChatChoice:
        answer = choice.text if choice.splitter is None else choice.answer
        message = AssistantMessage(role=self.ctx.response_role, content=answer)
        if choice.splitter is not None and choice.splitter.had_thought:
            message.content = answer or None  # all thought, no answer: null content, as vLLM's
            if request.include_reasoning:
                message.reasoning_content = message.reasoning = choice.reasoning
        finish_reason = choice.finish_reason
        if request.offered_tools():  # tool calls are read from the answer only
            parsed = parse_answer(self.tools.format, answer)
            message.content, message.tool_calls = parsed.content, tool_calls(parsed)
            finish_reason = _with_calls(finish_reason, bool(parsed.calls))
        logprobs = self._logprobs(request, choice.logprobs)
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=choice.stop_string if finish_reason == "stop" else None,
        )

    def _prompt_logprobs(self, request: ChatCompletionRequest, choices: list[Choice]) -> PromptLogprobs | None:
        scored = choices[0].prompt_logprobs if choices else None
        if request.prompt_logprobs is None or scored is None:
            return None
        return prompt_logprobs(scored, request.prompt_logprobs, self.ctx.tokenizer.token_text)

    def first_chunks(self, request_id: str, request: ChatCompletionRequest, choices: list[Choice]) -> list[BaseModel]:
        if request.offered_tools():
            for c in choices:
                c.tool_parser = ToolCallParser(self.tools.format)
        return [
            ChatCompletionChunk(
                id=request_id,
                model=request.model,
                choices=[ChatChunkChoice(index=c.index, delta=DeltaMessage(role=self.ctx.response_role, content=""))],
            )
            for c in choices
        ]

    def chunk(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        choice: Choice,
        output: RequestOutput,
        usage: Usage | None,
    ) -> BaseModel | None:
        content, calls = output.text, list[DeltaToolCall]()
        reasoning = ""
        if choice.splitter is not None:
            reasoning, content = self._reasoning_delta(request, choice, output), choice.last_split[1]
        finish_reason = output.finish_reason.value if output.finish_reason else None
        parser = choice.tool_parser
        if parser is not None:  # fed the answer only
            events = parser.feed(content) + (parser.finish() if output.finished else [])
            content, calls = delta_parts(events)
            finish_reason = _with_calls(finish_reason, parser.called)
        if not (content or calls or reasoning or output.finished or (output.logprobs and request.logprobs)):
            return None
        return ChatCompletionChunk(
            id=request_id,
            model=request.model,
            choices=[
                ChatChunkChoice(
                    index=choice.index,
                    delta=DeltaMessage(
                        content=content or None,
                        reasoning_content=reasoning or None,
                        reasoning=reasoning or None,
                        tool_calls=calls or None,
                    ),
                    logprobs=self._logprobs(request, output.logprobs or []),
                    finish_reason=finish_reason,
                    stop_reason=output.stop_string if finish_reason == "stop" else None,
                )
            ],
            usage=usage,
        )

    @staticmethod
    def _reasoning_delta(request: ChatCompletionRequest, choice: Choice, output: RequestOutput) -> str:
        """The thought this output adds to the stream: none when it is left out; with stream_reasoning false, all
        of it at once when it ends."""
        if not request.include_reasoning or choice.splitter is None:
            return ""
        if request.stream_reasoning:
            return choice.last_split[0]
        if choice.splitter.thinking and not output.finished:
            return ""
        sent, choice.reasoning_sent = choice.reasoning_sent, True
        return "" if sent else choice.reasoning

    def usage_chunk(self, request_id: str, request: ChatCompletionRequest, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(id=request_id, model=request.model, choices=[], usage=usage)

    def _logprobs(self, request: ChatCompletionRequest, items: list[TokenLogprob]) -> ChatLogprobs | None:
        if not request.logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(item) for item in items])

    def _token_logprob(self, item: TokenLogprob) -> ChatTokenLogprob:
        text = self.ctx.tokenizer.token_text(item.token_id)
        return ChatTokenLogprob(
            token=text,
            logprob=item.logprob,
            bytes=list(text.encode()),
            top_logprobs=[self._top(token_id, logprob) for token_id, logprob in item.top],
        )

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.ctx.tokenizer.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _with_calls(finish_reason: str | None, called: bool) -> str | None:
    """An answer that calls tools and ends of itself finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason
