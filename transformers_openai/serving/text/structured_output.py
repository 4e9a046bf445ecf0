"""Structured outputs: `response_format` JSON schemas and Lark grammars enforced token by token with llguidance.

Each request gets its own matcher, a `GrammarConstraint` for the engine (`grammar_constraint.py`). A grammar is
compiled once per distinct schema, off the event loop and off the engine thread, and kept within a byte budget
(`grammar_cache.py`); each request deep-copies the compiled matcher (microseconds: the copy shares the compiled
grammar and lexer) instead of compiling it again. A schema that is too large, that llguidance cannot take, or that
passes llguidance's limits while it is compiled is a 400.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance.hf
import llguidance.numpy
import numpy as np
import torch
from llguidance import LLMatcher, LLParserLimits
from numpy.typing import NDArray

from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.text.grammar_cache import CompiledGrammar, GrammarCache, estimate_bytes
from transformers_openai.serving.text.grammar_constraint import (
    GrammarConstraint,
    MaskBudget,
    MaskWorkers,
    disallowed_tokens,
    llguidance_error,
)

logger = logging.getLogger(__name__)

# llguidance's limits on one grammar. Its regex ASTs may take 200k units of fuel (the default 1M let `^x{50000}$`
# through, tens of milliseconds a mask): the tests' walks over 64 KiB object schemas, 5,000-string enums and 1,200
# patterns stay within it. Lexer states are kept with the cached grammar: 20,000 at most.
# Errors without the parser's state (it quotes the answer so far and the grammar).
LIMITS = LLParserLimits(initial_lexer_fuel=200_000, max_lexer_states=20_000, verbose_errors=False)
# Tokens the compile follows while the grammar forces them one by one (a schema whose root is a string, say), so
# that a lexeme past the limits is found there and refused with a 400 instead of failing a request mid-answer.
PROBE_TOKENS = 4
# What a Lark grammar's own rules may add to the schemas it embeds (`lark_constraints`): the thought before an
# answer (`thought_grammar`) takes about 300 bytes, a forced call's markers and repetition less.
WRAPPER_BYTES = 1024
# Schema keywords that only annotate: a schema differing only in them accepts the same answers, so they are dropped
# before the schema is compiled and keyed (variants share one cache entry).
ANNOTATIONS = frozenset({"description", "title", "examples", "$comment"})
# Keywords whose value maps names to subschemas (the names are data: a property may be called "title").
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def without_annotations(schema: Any) -> Any:
    """`schema` without its annotation keywords (`ANNOTATIONS`), at every level, property names kept."""
    if isinstance(schema, list):
        return [without_annotations(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            kept[key] = {name: without_annotations(sub) for name, sub in value.items()}
        elif key in ("enum", "const", "default", "required", "x-guidance"):
            kept[key] = value  # data, not schemas
        else:
            kept[key] = without_annotations(value)
    return kept


class StructuredOutputs:
    """Builds the per-request constraints of one served model; call `constraints` from a worker thread.

    Args:
        max_schema_bytes: the largest schema (compact JSON) or Lark grammar accepted; larger ones get 400.
        cache_bytes: what the compiled grammars kept between requests may take (`GrammarCache`).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_schema_bytes: int = 64 * 1024,
        cache_bytes: int = 256 * 1024 * 1024,
        workers: MaskWorkers | None = None,
        budget: MaskBudget | None = None,
    ) -> None:
        self._hf_tokenizer = copy.deepcopy(tokenizer)  # read only here, never beside the encoding threads' copy
        self._tokenizer: Any = None  # llguidance's view of it, made by `warm_up` or the first structured request
        self.max_schema_bytes = max_schema_bytes
        self.cache = GrammarCache(cache_bytes)
        self._workers = workers or MaskWorkers()
        self._budget = budget or MaskBudget()
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}  # keys being compiled

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
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
        self._check_size(size, "JSON schema", "its compact JSON", param)
        stripped = without_annotations(schema)
        # Compact JSON (no free whitespace): a small model cannot wander off in blank lines; a schema may still
        # ask for flexible whitespace with its own "x-guidance".
        return self._constraints(
            "json:" + json.dumps(stripped, sort_keys=True, separators=(",", ":")),
            lambda: LLMatcher.grammar_from_json_schema(stripped, defaults={"whitespace_flexible": False}),
            count,
            param,
            "the JSON schema",
        )

    def lark_constraints(self, lark: str, count: int, param: str, what: str = "the grammar") -> list[GrammarConstraint]:
        """`count` fresh constraints for answers in a Lark grammar (llguidance's dialect: a request's own grammar,
        choice list or regex, forced tool calls, an answer's grammar after a thought), `what` naming it in a 400:
        its rules beside the schemas it embeds get `WRAPPER_BYTES` of room, so that a schema accepted alone is
        accepted inside them."""
        size = len(lark.encode())
        if size - WRAPPER_BYTES > self.max_schema_bytes:
            self._check_size(size - WRAPPER_BYTES, "grammar", "its schemas, past its rules", param)
        return self._constraints("lark:" + lark, lambda: LLMatcher.grammar_from_lark(lark), count, param, what)

    def _check_size(self, size: int, what: str, measure: str, param: str) -> None:
        if size > self.max_schema_bytes:
            message = (
                f"the {what} is {size:,} bytes ({measure}); at most {self.max_schema_bytes:,} are accepted "
                "(--max-schema-bytes)"
            )
            raise BadRequestError(message, param=param, code="schema_too_large")

    def _constraints(
        self, key: str, build: Callable[[], str], count: int, param: str, what: str
    ) -> list[GrammarConstraint]:
        tokenizer = self._llg_tokenizer(param)
        entry = self.cache.get(key) or self._compile_once(key, build, tokenizer, param, what)
        return [
            GrammarConstraint(
                entry.matcher.deep_copy(), tokenizer.vocab_size, entry.first_disallowed, self._workers, self._budget
            )
            for _ in range(count)
        ]

    def _llg_tokenizer(self, param: str) -> Any:
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
                except Exception as exc:  # e.g. a slow (Python) tokenizer
                    message = f"structured outputs are not available for this model's tokenizer: {exc}"
                    raise BadRequestError(message, param=param) from exc
            return self._tokenizer

    def _compile_once(
        self, key: str, build: Callable[[], str], tokenizer: Any, param: str, what: str
    ) -> CompiledGrammar:
        """One compile of a key at a time: requests that ask for it meanwhile wait for its grammar, or its 400."""
        with self._lock:
            cached = self.cache.get(key)  # compiled since the caller looked (kept before its flight ends)
            if cached is not None:
                return cached
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not leader:
            flight.done.wait()
            if flight.entry is None:  # its own 400, raised afresh in this thread
                error = flight.error or BadRequestError(f"{what} cannot be used")
                raise BadRequestError(error.message, param=param, code=error.code)
            return flight.entry
        try:
            flight.entry = self._compile(key, build, tokenizer, param, what)
            return flight.entry
        except BadRequestError as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()

    def _compile(self, key: str, build: Callable[[], str], tokenizer: Any, param: str, what: str) -> CompiledGrammar:
        """Compiles a grammar (llguidance drops the GIL meanwhile), computes its first mask and probes its forced
        tokens, refusing it if these masks alone take more than the rows' budget allows at first; keeps it in the
        cache."""
        try:
            grammar = build()
            matcher = LLMatcher(tokenizer, grammar, limits=LIMITS)
        except Exception as exc:  # llguidance refuses what it cannot read
            raise BadRequestError(f"{what} cannot be used: {str(exc) or type(exc).__name__}", param=param) from exc
        bitmask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        start = time.thread_time()
        if not matcher.is_error():
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        first_mask_s = time.thread_time() - start
        error = matcher.get_error() or _probe(matcher, bitmask, tokenizer.vocab_size)
        if error:
            raise BadRequestError(f"{what} cannot be used: {llguidance_error(error)}", param=param)
        probed_s = time.thread_time() - start
        if probed_s > self._budget.grace_s:  # what every answer would spend on its first masks: refused up front
            message = (
                f"{what} is too costly to follow: its first token masks took {probed_s * 1000:.0f} ms of CPU time "
                f"(at most {self._budget.grace_s * 1000:.0f} ms); simplify its patterns or repetitions"
            )
            raise BadRequestError(message, param=param, code="grammar_too_costly")
        entry = CompiledGrammar(
            matcher, disallowed_tokens(bitmask, tokenizer.vocab_size), first_mask_s, estimate_bytes(grammar)
        )
        self.cache.put(key, entry)
        return entry


@dataclass
class _Flight:
    """A compile in progress, and what it gave."""

    done: threading.Event = field(default_factory=threading.Event)
    entry: CompiledGrammar | None = None
    error: BadRequestError | None = None


def _probe(matcher: Any, first: NDArray[np.int32], vocab: int) -> str:
    """The error llguidance meets while the grammar forces its first tokens one at a time (at most `PROBE_TOKENS`),
    on a copy of `matcher` whose first mask is `first`; empty if none."""
    probe = None
    bitmask = first.copy()
    for _ in range(PROBE_TOKENS):
        allowed = (~disallowed_tokens(bitmask, vocab)).nonzero().flatten().tolist()
        if len(allowed) != 1:
            break
        probe = probe or matcher.deep_copy()
        if not probe.consume_token(allowed[0]) or probe.is_stopped():
            break
        llguidance.numpy.fill_next_token_bitmask(probe, bitmask, 0)
    return str(probe.get_error()) if probe is not None else ""
