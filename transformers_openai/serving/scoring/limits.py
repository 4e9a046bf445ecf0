"""The bounds of a score request, checked before any model work: each input within the model's length (unless the
request asks to truncate), and all of them within the request's token budget.

As /v1/embeddings does, characters are checked before tokenizing (no token stands for more than the vocabulary's
longest, so a text of more characters than that many tokens could hold is refused unread) and tokens after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers_openai.serving.errors import BadRequestError

Describe = Callable[[int], tuple[str, str]]  # input index -> (how a message names it, the request field it is in)


@dataclass(frozen=True)
class ScoreLimits:
    """`max_input_len`: tokens of one input (a cross-encoder's pair, or one text of an embedding model);
    `max_total_tokens`: of all a request's inputs (--max-embedding-tokens); `token_chars`: the most characters one
    token stands for (0: unknown, no character checks)."""

    max_input_len: int
    max_total_tokens: int
    token_chars: int = 0

    def keep(self, truncate: int | None) -> int | None:
        """The tokens each input is cut to: None (no truncation), or `truncate_prompt_tokens` (-1: the model's
        limit), which may not pass the model's limit."""
        if truncate is None:
            return None
        keep = self.max_input_len if truncate == -1 else truncate
        if keep > self.max_input_len:
            raise BadRequestError(
                f"truncate_prompt_tokens {keep} is more than this model's {self.max_input_len} input tokens",
                param="truncate_prompt_tokens",
            )
        return keep

    def check_chars(self, chars: list[int], keep: int | None, describe: Describe) -> None:
        """Inputs of `chars` characters each: none too long to fit the model, together not past the budget."""
        if not self.token_chars:
            return
        if keep is None:
            most = self.max_input_len * self.token_chars
            for i, count in enumerate(chars):
                if count > most:
                    name, param = describe(i)
                    raise BadRequestError(
                        f"{name} has {count} characters; an input may have at most {most} (this model's "
                        f"{self.max_input_len} tokens times {self.token_chars} characters, its longest token); "
                        "shorten it or set truncate_prompt_tokens",
                        param=param,
                        code="context_length_exceeded",
                    )
        clip = keep * self.token_chars if keep is not None else None  # past what the kept tokens could stand for
        total = sum(min(count, clip or count) for count in chars)
        if total > self.max_total_tokens * self.token_chars:
            raise BadRequestError(
                f"the inputs have {total} characters together; a request may have at most "
                f"{self.max_total_tokens * self.token_chars} ({self.max_total_tokens} tokens, --max-embedding-tokens, "
                f"times {self.token_chars} characters, this model's longest token): send fewer or shorter texts",
                param=describe(len(chars) - 1)[1],
                code="max_tokens_per_request",
            )

    def check_tokens(self, lengths: list[int], keep: int | None, describe: Describe, first: int = 0) -> None:
        """Inputs `first`, `first + 1`, ... of `lengths` tokens each: none empty, none longer than the model takes
        (or than `keep`: a pair's special tokens alone may pass it), within the budget together."""
        limit = keep or self.max_input_len
        for i, count in enumerate(lengths, start=first):
            name, param = describe(i)
            if not count:
                raise BadRequestError(f"{name} has no tokens", param=param)
            if count > limit and keep is not None:
                raise BadRequestError(
                    f"truncate_prompt_tokens {keep} is too few for {name}: the tokenizer left {count} tokens (the "
                    "special tokens around a pair are never cut)",
                    param="truncate_prompt_tokens",
                )
            if count > limit:
                raise BadRequestError(
                    f"{name} has {count} tokens, more than this model's {limit}; shorten it or set "
                    "truncate_prompt_tokens",
                    param=param,
                    code="context_length_exceeded",
                )

    def check_total(self, tokens: int, param: str) -> None:
        if tokens > self.max_total_tokens:
            raise BadRequestError(
                f"the inputs have {tokens} tokens together; this server scores at most {self.max_total_tokens} "
                "tokens per request (--max-embedding-tokens): send fewer or shorter texts, or set "
                "truncate_prompt_tokens",
                param=param,
                code="max_tokens_per_request",
            )
