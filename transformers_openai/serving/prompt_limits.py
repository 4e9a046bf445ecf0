"""Cheap limits on a prompt, read from the request's raw JSON before it is validated, templated or tokenized.

A 10 MB body of 300,000 empty messages costs seconds of validation and rendering and hundreds of MB before
the context limit can refuse it; counting its messages and characters costs microseconds. What passes here
still meets every exact check later: these limits only refuse what could never be served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers_openai.serving.errors import BadRequestError


@dataclass(frozen=True)
class PromptLimits:
    """Args:
    max_messages: messages a chat may have (`--max-chat-messages`).
    max_content_parts: content parts all of a chat's messages may have together (`--max-content-parts`).
    max_prompt_tokens: the most tokens a prompt can ever have (the context, or an encoder's input limit).
    max_token_chars: the most characters one token of the vocabulary stands for, so a text of more than
        `max_prompt_tokens * max_token_chars` characters cannot fit in any tokenization.
    max_sequences: sequences the engine holds at once (running and waiting): completions' prompts times `n`.
    """

    max_messages: int
    max_content_parts: int
    max_prompt_tokens: int
    max_token_chars: int
    max_sequences: int

    @property
    def max_chars(self) -> int:
        return self.max_prompt_tokens * max(1, self.max_token_chars)

    def check_chat(self, body: Any) -> None:
        """Refuses a chat body over a limit; anything malformed is left to validation."""
        if isinstance(body, dict):
            self._check_messages(body.get("messages"), "messages", ("content",))

    def check_responses(self, body: Any) -> None:
        """Refuses a /v1/responses body over a limit: its input items count as chat messages."""
        if not isinstance(body, dict):
            return
        items = body.get("input")
        if isinstance(items, str):
            self._check_chars(len(items), "input")
        else:
            self._check_messages(items, "input", ("content", "output", "arguments"))

    def check_tokenize(self, body: Any) -> None:
        """Refuses a /tokenize body over a limit: messages as chat counts them, a prompt as completions does."""
        if not isinstance(body, dict):
            return
        if "messages" in body:
            self.check_chat(body)
        elif isinstance(body.get("prompt"), str):
            self._check_chars(len(body["prompt"]), "prompt")

    def check_detokenize(self, body: Any, max_model_len: int) -> None:
        """Refuses a /detokenize body of more tokens than a prompt and its completion could ever have."""
        tokens = body.get("tokens") if isinstance(body, dict) else None
        most = max(self.max_prompt_tokens, max_model_len)
        if isinstance(tokens, list) and len(tokens) > most:
            raise BadRequestError(
                f"'tokens' has {len(tokens)} tokens; this server detokenizes at most {most}, the model's context",
                param="tokens",
                code="context_length_exceeded",
            )

    def _check_messages(self, messages: Any, param: str, text_keys: tuple[str, ...]) -> None:
        if not isinstance(messages, list):
            return
        noun = "messages" if param == "messages" else "input items"
        if len(messages) > self.max_messages:
            raise BadRequestError(
                f"'{param}' has {len(messages)} {noun}; this server takes at most {self.max_messages} "
                "(--max-chat-messages)",
                param=param,
                code="too_many_messages",
            )
        parts = chars = 0
        for message in messages:
            for key in text_keys:
                content = message.get(key) if isinstance(message, dict) else None
                if isinstance(content, str):
                    chars += len(content)
                elif isinstance(content, list):
                    parts += len(content)
                    chars += sum(
                        len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
                    )
        if parts > self.max_content_parts:
            raise BadRequestError(
                f"the {noun} have {parts} content parts together; this server takes at most "
                f"{self.max_content_parts} (--max-content-parts)",
                param=param,
                code="too_many_content_parts",
            )
        self._check_chars(chars, param)

    def check_completion(self, body: Any) -> None:
        """Refuses a completions body whose prompts could never be served; the rest is left to validation."""
        if not isinstance(body, dict):
            return
        prompt = body.get("prompt")
        n = body.get("n")
        choices = n if isinstance(n, int) and n > 0 else 1
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) * choices > self.max_sequences:
                raise BadRequestError(  # as the engine's own refusal says it
                    f"{len(prompt)} prompts with n={choices} need {len(prompt) * choices} sequences, but the server "
                    f"holds at most {self.max_sequences} at once (--max-batch-size plus --max-queue); lower n or "
                    "send fewer prompts",
                    param="n",
                    code="too_many_sequences",
                )
            for item in prompt:
                self._check_prompt(item)
        else:
            self._check_prompt(prompt)

    def _check_prompt(self, prompt: Any) -> None:
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
        elif isinstance(prompt, list) and len(prompt) > self.max_prompt_tokens:
            raise BadRequestError(
                f"the prompt is {len(prompt)} tokens long but the model's context is {self.max_prompt_tokens} "
                "tokens; shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            least = -(-chars // max(1, self.max_token_chars))
            raise BadRequestError(
                f"the prompt has {chars} characters, at least {least} tokens, but the model's context is "
                f"{self.max_prompt_tokens} tokens; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
