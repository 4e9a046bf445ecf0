"""Structured outputs: `response_format` JSON schemas enforced token by token with llguidance.

Each request gets its own matcher, a `TokenConstraint` for the engine: before every draw it masks the tokens the
grammar does not allow next, and every sampled token advances it. Grammars are compiled and checked off the event
loop and off the engine thread, once per distinct schema (cached); a schema llguidance cannot take is a 400.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance.hf
import llguidance.torch
import numpy as np
import torch
from llguidance import LLMatcher

from transformers_openai.serving.errors import BadRequestError

logger = logging.getLogger(__name__)

# Distinct schemas whose compiled grammar is kept.
GRAMMAR_CACHE_SIZE = 256


class GrammarConstraint:
    """One request's grammar state: masks the logits of the tokens it does not allow next, advances per token."""

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        # Token i is allowed when bit i % 32 of little-endian word i // 32 is set: the words' bytes unpacked
        # little-endian first are the tokens in order. Not llguidance's own helper: a torch.compile kernel,
        # compiled on first use (seconds) and again whenever its guards change (another thread, inference mode),
        # each time on the engine thread.
        words = self._bitmask[0].numpy().view(np.uint8)
        allowed = torch.from_numpy(np.unpackbits(words, bitorder="little")[: self._vocab])
        logits[: self._vocab].masked_fill_(allowed.to(device=logits.device) == 0, float("-inf"))
        logits[self._vocab :] = float("-inf")  # the model's padding beyond the tokenizer's vocabulary

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"the grammar did not allow token {token_id}: {self._matcher.get_error()}")

    def is_done(self) -> bool:
        return bool(self._matcher.is_stopped())


class StructuredOutputs:
    """Builds the per-request constraints of one served model; call `constraints` from a worker thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._hf_tokenizer = copy.deepcopy(tokenizer)  # read only here, never beside the encoding threads' copy
        self._tokenizer: Any = None  # llguidance's view of it, made by `warm_up` or the first structured request
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Builds llguidance's view of the tokenizer, one grammar and its first token mask now (at start-up), so
        that the first structured request does not: the view takes a quarter of a second with SmolLM2's
        vocabulary, holding the GIL the engine thread needs while streams run."""
        try:
            constraint = self.constraints({"type": "object"}, 1, "response_format")[0]
        except BadRequestError as exc:  # e.g. a slow tokenizer: each structured request will get this 400
            logger.info("structured outputs are not available: %s", exc.message)
            return
        constraint.mask(torch.zeros(constraint.vocab_size))

    def constraints(self, schema: dict[str, Any], count: int, param: str) -> list[GrammarConstraint]:
        """`count` fresh constraints for answers following `schema`; a 400 naming `param` if it cannot be used."""
        # Compact JSON (no free whitespace): a small model cannot wander off in blank lines; a schema may still
        # ask for flexible whitespace with its own "x-guidance".
        return self._constraints(
            json.dumps(schema, sort_keys=True),
            lambda: LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}),
            count,
            param,
        )

    def lark_constraints(self, lark: str, count: int, param: str) -> list[GrammarConstraint]:
        """`count` fresh constraints for answers in a Lark grammar (llguidance's dialect, e.g. forced tool calls)."""
        return self._constraints("lark:" + lark, lambda: LLMatcher.grammar_from_lark(lark), count, param)

    def _constraints(self, key: str, build: Callable[[], str], count: int, param: str) -> list[GrammarConstraint]:
        tokenizer = self._llg_tokenizer(param)
        grammar = self._grammar(key, build, tokenizer, param)
        return [GrammarConstraint(LLMatcher(tokenizer, grammar), tokenizer.vocab_size) for _ in range(count)]

    def _llg_tokenizer(self, param: str) -> Any:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
                except Exception as exc:  # e.g. a slow (Python) tokenizer
                    message = f"structured outputs are not available for this model's tokenizer: {exc}"
                    raise BadRequestError(message, param=param) from exc
            return self._tokenizer

    def _grammar(self, key: str, build: Callable[[], str], tokenizer: Any, param: str) -> str:
        with self._lock:
            cached = self._grammars.get(key)
            if cached is not None:
                self._grammars.move_to_end(key)
                return cached
        try:
            grammar = build()
            error = LLMatcher.validate_grammar(grammar, tokenizer)
        except Exception as exc:  # llguidance refuses what it cannot read
            error = str(exc) or type(exc).__name__
        if error:
            raise BadRequestError(f"the JSON schema cannot be used: {error}", param=param)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar
