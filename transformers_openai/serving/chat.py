"""POST /v1/chat/completions: messages through the chat template, answers as chat completions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from transformers_openai.engine.request import RequestOutput, TokenLogprob
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
    PromptLogprobs,
    TopLogprob,
    Usage,
)
from transformers_openai.serving.base import Choice, GenerationHandler, Prompt
from transformers_openai.serving.prompt_scores import prompt_logprobs


class ChatHandler(GenerationHandler[ChatCompletionRequest]):
    request_id_prefix = "chatcmpl-"
    endpoint = "chat_completions"

    async def prompts(self, request: ChatCompletionRequest) -> list[Prompt]:
        messages = [
            # OpenAI's "developer" role is the newer name of "system"; templates know the latter.
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in request.messages
        ]
        tokenizer = self.ctx.tokenizer
        if self.ctx.encoder_decoder and not tokenizer.has_chat_template:
            # Seq2seq models are mostly prompted with plain text: the contents, one message per line.
            return [Prompt(await tokenizer.encode_text("\n".join(m["content"] for m in messages)))]
        return [Prompt(await tokenizer.encode_chat(messages))]

    def answer_schema(self, request: ChatCompletionRequest) -> dict[str, Any] | None:
        return request.response_format.answer_schema() if request.response_format else None

    def response(
        self, request_id: str, request: ChatCompletionRequest, choices: list[Choice], usage: Usage
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request_id,
            model=request.model,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(role=self.ctx.response_role, content=c.text),
                    logprobs=self._logprobs(request, c.logprobs),
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
            usage=usage,
            prompt_logprobs=self._prompt_logprobs(request, choices),
        )

    def _prompt_logprobs(self, request: ChatCompletionRequest, choices: list[Choice]) -> PromptLogprobs | None:
        scored = choices[0].prompt_logprobs if choices else None
        if request.prompt_logprobs is None or scored is None:
            return None
        return prompt_logprobs(scored, request.prompt_logprobs, self.ctx.tokenizer.token_text)

    def first_chunks(self, request_id: str, request: ChatCompletionRequest, choices: list[Choice]) -> list[BaseModel]:
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
        if not output.text and not output.finished and not (output.logprobs and request.logprobs):
            return None
        return ChatCompletionChunk(
            id=request_id,
            model=request.model,
            choices=[
                ChatChunkChoice(
                    index=choice.index,
                    delta=DeltaMessage(content=output.text or None),
                    logprobs=self._logprobs(request, output.logprobs or []),
                    finish_reason=output.finish_reason.value if output.finish_reason else None,
                )
            ],
            usage=usage,
        )

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
