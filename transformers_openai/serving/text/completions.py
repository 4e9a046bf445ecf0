"""POST /v1/completions: raw prompts (text or token ids), answers as text completions."""

from __future__ import annotations

from pydantic import BaseModel

from transformers_openai.engine.request import RequestOutput, TokenLogprob
from transformers_openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    Usage,
)
from transformers_openai.serving.base import AnswerGrammar, Choice, GenerationHandler, Prompt, check_token_ids
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.output_constraints import answer_grammar_of
from transformers_openai.serving.text.prompt_scores import prompt_logprobs


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
        if request.max_tokens == 0 and not request.echo:
            raise BadRequestError(
                "max_tokens 0 generates nothing: it needs 'echo' (to return the prompt, scored with 'logprobs')",
                param="max_tokens",
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

    def answer_grammar(self, request: CompletionRequest, prompts: list[Prompt]) -> AnswerGrammar | None:
        return answer_grammar_of(request.output_constraints())

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
                    logprobs=self._choice_logprobs(request, c),
                    finish_reason=c.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(request, c),
                )
                for c in choices
            ],
            usage=usage,
        )

    def first_chunks(self, request_id: str, request: CompletionRequest, choices: list[Choice]) -> list[BaseModel]:
        if not request.echo or request.logprobs is not None:
            return []  # with logprobs, the echoed prompt goes out with its scores, in the first output's chunk
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
        scored_prompt = request.echo and output.prompt_logprobs is not None
        if not (output.text or output.finished or scored_prompt or (output.logprobs and request.logprobs is not None)):
            return None
        offset = self._start(request, choice) + len(choice.text) - len(output.text)
        logprobs = self._logprobs(request, output.logprobs or [], offset)
        text = output.text
        if scored_prompt:
            text = (choice.prompt.text or "") + text
            logprobs = self._with_prompt(request, choice, logprobs)
        return CompletionResponse(
            id=request_id,
            model=request.model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=output.finish_reason.value if output.finish_reason else None,
                )
            ],
            usage=usage,
        )

    def usage_chunk(self, request_id: str, request: CompletionRequest, usage: Usage) -> BaseModel:
        return CompletionResponse(id=request_id, model=request.model, choices=[], usage=usage)

    def _choice_logprobs(self, request: CompletionRequest, choice: Choice) -> CompletionLogprobs | None:
        generated = self._logprobs(request, choice.logprobs, self._start(request, choice))
        return self._with_prompt(request, choice, generated)

    def _prompt_logprobs(self, request: CompletionRequest, choice: Choice) -> PromptLogprobs | None:
        if request.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        return prompt_logprobs(choice.prompt_logprobs, request.prompt_logprobs, self.ctx.tokenizer.token_text)

    @staticmethod
    def _start(request: CompletionRequest, choice: Choice) -> int:
        """Where the completion starts in the returned text: after the prompt when it is echoed."""
        return len(choice.prompt.text or "") if request.echo else 0

    def _with_prompt(
        self, request: CompletionRequest, choice: Choice, generated: CompletionLogprobs | None
    ) -> CompletionLogprobs | None:
        """With echo: the prompt tokens' scores (the first one null, as OpenAI and vLLM give it) before the rest."""
        if generated is None or not request.echo or choice.prompt_logprobs is None:
            return generated
        token_text = self.ctx.tokenizer.token_text
        scored = CompletionLogprobs()
        offset = 0
        for token_id, entry in zip(choice.prompt.token_ids, choice.prompt_logprobs, strict=True):
            text = token_text(token_id)
            scored.tokens.append(text)
            scored.token_logprobs.append(None if entry is None else entry.logprob)
            top = [] if entry is None else entry.top[: request.logprobs]
            scored.top_logprobs.append(None if entry is None else {token_text(t): lp for t, lp in top})
            scored.text_offset.append(offset)
            offset += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(scored, name).extend(getattr(generated, name))
        return scored

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
