"""POST /v1/completions: raw prompts (text or token ids), answers as text completions."""

from __future__ import annotations

from pydantic import BaseModel

from transformers_openai.engine.request import RequestOutput, TokenLogprob
from transformers_openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from transformers_openai.serving.base import Choice, GenerationHandler, Prompt, check_token_ids
from transformers_openai.serving.errors import BadRequestError


class CompletionHandler(GenerationHandler[CompletionRequest]):
    request_id_prefix = "cmpl-"
    endpoint = "completions"
    default_max_tokens_when_unset = 16  # OpenAI's documented default for this endpoint

    async def prompts(self, request: CompletionRequest) -> list[Prompt]:
        if request.echo and self.ctx.encoder_decoder:
            raise BadRequestError(
                "'echo' is not supported for encoder-decoder models: the prompt is not part of their output",
                param="echo",
            )
        prompts = []
        for prompt in request.prompts():
            if isinstance(prompt, str):
                ids = await self.ctx.tokenizer.encode_text(prompt)
                prompts.append(Prompt(ids, prompt))
            else:
                check_token_ids(prompt, self.ctx.tokenizer.vocab_size)  # before anything decodes them
                text = await self.ctx.tokenizer.decode(prompt) if request.echo else None
                prompts.append(Prompt(list(prompt), text))
        return prompts

    def response(
        self, request_id: str, request: CompletionRequest, choices: list[Choice], usage: Usage
    ) -> CompletionResponse:
        return CompletionResponse(
            id=request_id,
            model=request.model,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=(c.prompt.text or "") + c.text if request.echo else c.text,
                    logprobs=self._logprobs(request, c.logprobs, 0),
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
            usage=usage,
        )

    def first_chunks(self, request_id: str, request: CompletionRequest, choices: list[Choice]) -> list[BaseModel]:
        if not request.echo:
            return []
        return [
            CompletionResponse(
                id=request_id, model=request.model, choices=[CompletionChoice(index=c.index, text=c.prompt.text or "")]
            )
            for c in choices
        ]

    def chunk(
        self,
        request_id: str,
        request: CompletionRequest,
        choice: Choice,
        output: RequestOutput,
        usage: Usage | None,
    ) -> BaseModel | None:
        if not output.text and not output.finished and not (output.logprobs and request.logprobs is not None):
            return None
        offset = len(choice.text) - len(output.text)
        return CompletionResponse(
            id=request_id,
            model=request.model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=output.text,
                    logprobs=self._logprobs(request, output.logprobs or [], offset),
                    finish_reason=output.finish_reason.value if output.finish_reason else None,
                )
            ],
            usage=usage,
        )

    def usage_chunk(self, request_id: str, request: CompletionRequest, usage: Usage) -> BaseModel:
        return CompletionResponse(id=request_id, model=request.model, choices=[], usage=usage)

    def _logprobs(
        self, request: CompletionRequest, items: list[TokenLogprob], offset: int
    ) -> CompletionLogprobs | None:
        if request.logprobs is None:
            return None
        result = CompletionLogprobs()
        token_text = self.ctx.tokenizer.token_text
        for item in items:
            text = token_text(item.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(item.logprob)
            result.top_logprobs.append({token_text(t): lp for t, lp in item.top})
            result.text_offset.append(offset)
            offset += len(text)
        return result
