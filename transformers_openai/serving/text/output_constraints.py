"""The one constraint a request sets on its answer, as the grammar the engine follows.

A JSON schema stays a schema. A choice list, a regex and a grammar become Lark grammars (llguidance's dialect), so
that each can also be nested after a reasoning model's thought (`thought_grammar.py`) and is compiled, cached and
refused with a 400 by the one path of `StructuredOutputs.lark_constraints`:
- a choice list: the alternation of its strings, each an exact literal;
- a regex: one lexeme matching it, the whole answer (llguidance's regex syntax, Rust's `regex` crate without
  look-around: `\\d`, `\\w` and `\\s` are Unicode classes as in Python's `re`; `^` and `$` are allowed);
- a grammar: Lark as llguidance reads it (a `start` rule, or `%llguidance`), else GBNF as llama.cpp writes it (a
  `root` rule), which llguidance's converter turns into Lark.
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from transformers_openai.protocol.structured_outputs import OutputConstraint
from transformers_openai.serving.base import AnswerGrammar
from transformers_openai.serving.errors import BadRequestError


def answer_grammar_of(constraints: list[OutputConstraint]) -> AnswerGrammar | None:
    """The grammar of the request's one constraint (None without one); a 400 naming both when it sets two."""
    if not constraints:
        return None
    if len(constraints) > 1:
        first, second = constraints[0].param, constraints[1].param
        message = f"only one constraint on the answer can be given, but both '{first}' and '{second}' were given"
        raise BadRequestError(message, param=second, code="conflicting_constraints")
    constraint = constraints[0]
    if constraint.kind == "json":
        return AnswerGrammar(constraint.param, schema=constraint.value)
    if constraint.kind == "choice":
        return AnswerGrammar(constraint.param, lark=choice_lark(constraint.value), what="the choice list")
    if constraint.kind == "regex":
        return AnswerGrammar(constraint.param, lark=regex_lark(constraint.value, constraint.param), what="the regex")
    return AnswerGrammar(constraint.param, lark=grammar_lark(constraint.value, constraint.param), what="the grammar")


def choice_lark(choices: list[str]) -> str:
    """The answer is exactly one of `choices` (JSON's string escapes are Lark's)."""
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def regex_lark(regex: str, param: str) -> str:
    """The answer matches `regex` whole. Its syntax is checked when the grammar is compiled."""
    try:
        return "start: /" + llguidance.regex_to_lark(regex) + "/"
    except Exception as exc:  # the converter refusing a pattern it cannot quote
        raise BadRequestError(f"the regex cannot be used: {exc}", param=param) from exc


def grammar_lark(grammar: str, param: str) -> str:
    """A Lark grammar as it is; GBNF converted to Lark, a 400 naming `param` where it cannot be read."""
    try:
        return any_to_lark(grammar)
    except Exception as exc:  # the converter's own errors, and plain ones ("No 'root' rule found")
        message = f"the grammar is neither Lark (a 'start' rule) nor GBNF (a 'root' rule) that can be read: {exc}"
        raise BadRequestError(message, param=param) from exc
