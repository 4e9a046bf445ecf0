"""The answer's grammar after a thought: free text up to the reasoning format's end marker, then the grammar itself.

A reasoning model thinks before it answers, so a JSON schema or a forced tool call cannot apply from the first
token: `after_thought` wraps the answer's grammar in a Lark grammar (llguidance's dialect) that lets the model write
any text, newlines and markup included, until it closes its thought, and only then forces the original grammar
(a JSON schema through `%json`, a Lark grammar through a nested `%lark` block, so that its own `start` rule and its
rule names stay its own). The thought may not end the answer (no end of sequence inside it): the answer must come.

The end marker is matched as the model can write it:
- an added token (Qwen3's and DeepSeek-R1's `</think>`): llguidance sees every added token as special, so it is
  matched by its id; the same text written in ordinary tokens (`</`, `think`, `>`) ends the thought too, since the
  reasoning split reads the decoded text and would split there;
- plain text: the first occurrence of the marker ends the thought (a lazy lexeme), as the split does.
Either way the thought cannot hold the marker: the grammar and the split agree where the answer begins.
"""

from __future__ import annotations

import json
from typing import Protocol

from transformers_openai.serving.base import AnswerGrammar
from transformers_openai.serving.text.structured_output import without_annotations


class ThoughtMarkers(Protocol):
    """What `after_thought` reads of a reasoning format: the markers around the thought."""

    @property
    def start(self) -> str: ...

    @property
    def end(self) -> str: ...


class AddedTokens(Protocol):
    """What `after_thought` reads of the tokenizer (`TokenizerService` is one)."""

    def added_token(self, text: str) -> tuple[int, bool] | None: ...


def after_thought(
    grammar: AnswerGrammar, fmt: ThoughtMarkers, tokens: AddedTokens, opened: bool = True
) -> AnswerGrammar:
    """`grammar` enforced only after the thought ends at `fmt.end`: a Lark grammar asked for by the same field.

    `opened`: the prompt leaves the model inside its thought (the template opened it), which must then end before
    the answer. Otherwise the model may open a thought itself, with `fmt.start` as its very first output (as Qwen3
    does where its template does not open one), or answer at once. A format without an end marker cannot say where
    its thought ends, nor one without a start marker where an unopened one begins: the grammar then applies from
    the first token."""
    if not fmt.end or (not opened and not fmt.start):
        return grammar
    lark = thought_lark(fmt, tokens, opened) + "\n" + _answer_rule(grammar)
    return AnswerGrammar(grammar.param, lark=lark, what=grammar.what)


def thought_lark(fmt: ThoughtMarkers, tokens: AddedTokens, opened: bool = True) -> str:
    """The rules `start: thought answer` (`thought? answer` when the prompt did not open the thought) and the
    thought's; the caller appends the `answer` rule."""
    end_text = json.dumps(fmt.end)  # a Lark string literal (JSON's escapes are Lark's)
    start_token = tokens.added_token(fmt.start) if fmt.start else None
    end_token = tokens.added_token(fmt.end)
    if opened:
        # The opening marker, when the template did not write it and it is a token (as text it is thought text).
        opening = f"<[{start_token[0]}]>? " if start_token is not None else ""
    else:  # the model opens it, or there is none
        opening = f"<[{start_token[0]}]> " if start_token is not None else json.dumps(fmt.start) + " "
    # Lazy: the text ends at the first end marker written as text.
    rules = [f"thought_text[lazy]: /(?s:.*)/ {end_text}"]
    if end_token is None:
        rules.insert(0, f"thought: {opening}thought_text")
    else:
        rules.insert(0, f"thought: {opening}(THOUGHT <[{end_token[0]}]> | thought_text)")
        rules.append(f"THOUGHT: /(?s:.*)/ & ~(/(?s:.*)/ {end_text} /(?s:.*)/)")
    return "\n".join(["start: thought answer" if opened else "start: thought? answer", *rules])


def _answer_rule(grammar: AnswerGrammar) -> str:
    if grammar.lark is not None:
        return "answer: %lark {\n" + grammar.lark + "\n}"
    # As `StructuredOutputs.constraints` compiles a schema alone: annotations dropped, compact JSON.
    schema = without_annotations(grammar.schema or {})
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return "answer: %json " + json.dumps(schema, sort_keys=True, separators=(",", ":"))
