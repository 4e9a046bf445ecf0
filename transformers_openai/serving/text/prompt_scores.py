"""A scored prompt in vLLM's `prompt_logprobs` shape: per token, its score and its alternatives', by token id."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers_openai.engine.request import TokenLogprob
from transformers_openai.protocol import PromptLogprobs, PromptTokenLogprob


def prompt_logprobs(
    scored: Sequence[TokenLogprob | None], alternatives: int, token_text: Callable[[int], str]
) -> PromptLogprobs:
    """The first token is None (nothing predicts it); each other entry holds the prompt token and its top ones."""
    out: PromptLogprobs = []
    for entry in scored:
        if entry is None:
            out.append(None)
            continue
        position = {
            str(token): PromptTokenLogprob(logprob=logprob, rank=rank, decoded_token=token_text(token))
            for rank, (token, logprob) in enumerate(entry.top[:alternatives], start=1)
        }
        position[str(entry.token_id)] = PromptTokenLogprob(
            logprob=entry.logprob, rank=entry.rank, decoded_token=token_text(entry.token_id)
        )
        out.append(position)
    return out
