"""Thoughts as the checkpoint's own `response_template` says (transformers' `parse_response` and `ResponseParser`).

The served answer keeps its tool-call markup for the server's tool parser, so the template is cut down to its
thought field and one field for all the rest; the text keeps its whitespace (the parser's default strips it), so
that a stream's pieces add up to the whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils.chat_parsing import ResponseParser
from transformers.utils.chat_parsing.response_templates import ResponseTemplate, load_response_template

from transformers_openai.serving.text.reasoning.splitter import ReasoningSplitter, split_whole

logger = logging.getLogger(__name__)

# Names a template gives its thought field, as transformers reads them (the first is the standard one).
THOUGHT_FIELDS = ("reasoning_content", "thinking", "reasoning")
ANSWER_FIELD = "content"
# Prompt tokens decoded to find where the assistant's message starts: a generation prompt's ending is short.
PROMPT_TAIL_TOKENS = 256


def _first_literal(value: Any) -> str | None:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and isinstance(value[0], str) and value[0]:
        return value[0]
    return None


def thought_template(template: Any) -> tuple[dict[str, Any], str, str, str] | None:
    """The template cut down to its thought and the rest, with the thought field's name and its first open and close
    literals; None when the template has no thought field delimited by literals (a pattern cannot be written back)."""
    fields = template.get("fields") if isinstance(template, dict) else None
    if not isinstance(fields, dict):
        return None
    name = next((n for n in THOUGHT_FIELDS if isinstance(fields.get(n), dict)), None)
    if name is None or name == ANSWER_FIELD:
        return None
    thought = fields[name]
    start, end = _first_literal(thought.get("open")), _first_literal(thought.get("close"))
    if start is None or end is None:
        return None
    keep = {"content": "text", "content_args": {"strip": False}}
    reduced: dict[str, Any] = {
        "fields": {name: {"open": thought["open"], "close": thought["close"], **keep}, ANSWER_FIELD: dict(keep)},
        **{key: template[key] for key in ("start_anchor", "start_anchor_pattern") if key in template},
    }
    return reduced, name, start, end


class TemplateSplitter(ReasoningSplitter):
    """transformers' streaming `ResponseParser` over the cut-down template: its thought field's pieces are the
    reasoning, the rest the content."""

    def __init__(self, spec: ResponseTemplate, field: str, opening: str | None) -> None:
        super().__init__(opening is not None)
        self._field = field
        self._parser = ResponseParser(spec, prefix=opening or "")
        self._thinking = opening is not None

    @property
    def thinking(self) -> bool:
        return self._thinking

    def _split(self, text: str) -> tuple[str, str]:
        return self._route(self._parser.feed(text))

    def _flush(self) -> tuple[str, str]:
        _, events = self._parser.finalize()
        return self._route(events)

    def _route(self, events: list[dict[str, Any]]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for event in events:
            in_thought = event.get("field") == self._field
            if event["type"] == "region_chunk":
                (reasoning if in_thought else content).append(str(event.get("text") or ""))
            elif in_thought:
                self._thinking = event["type"] == "region_open"
                if self._thinking:
                    self._had_thought = True
        return "".join(reasoning), "".join(content)


@dataclass(frozen=True)
class TemplateReasoning:
    """A reasoning format read from the tokenizer's `response_template`."""

    spec: ResponseTemplate
    template: dict[str, Any]  # the cut-down template, as `parse_response` takes it
    field: str
    start: str
    end: str
    decode: Callable[[list[int]], str]
    keeps_markers: bool = False
    name: str = "response_schema"

    @classmethod
    def of(cls, template: Any, decode: Callable[[list[int]], str]) -> TemplateReasoning | None:
        """The format of a tokenizer's template; None (and a warning) when it has no usable thought field."""
        reduced = thought_template(template)
        if reduced is None:
            logger.warning("the tokenizer's response_template has no thought field with literal markers: not used")
            return None
        spec_dict, field, start, end = reduced
        try:
            spec = load_response_template(spec_dict)
        except ValueError as exc:
            logger.warning("the tokenizer's response_template cannot be used: %s", exc)
            return None
        return cls(spec, spec_dict, field, start, end, decode)

    def thinks_at_start(self, prompt_ids: Sequence[int]) -> bool:
        parser = ResponseParser(self.spec, prefix=self.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])))
        thinking = False
        for event in parser.initial_events:
            if event.get("field") == self.field and event["type"] in ("region_open", "region_close"):
                thinking = event["type"] == "region_open"
        return thinking

    def splitter(self, thinking: bool) -> ReasoningSplitter:
        return TemplateSplitter(self.spec, self.field, self.start if thinking else None)

    def split(self, text: str, thinking: bool) -> tuple[str | None, str]:
        """What `parse_response` gives for the cut-down template, read from the same streaming parser as a stream
        is, so that the two agree to the character (`parse_response` keeps only the last piece of an answer field
        that a thought interrupts: text before the thought is content here)."""
        return split_whole(self.splitter(thinking), text)
