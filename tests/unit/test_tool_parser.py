"""The tool-call parser: calls and content read from each format, the same streamed in any pieces as whole."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from transformers_openai.serving.text.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from transformers_openai.serving.text.tool_parser import (
    ArgumentsDelta,
    CallScan,
    CallStarted,
    ContentDelta,
    ObjectScanner,
    ParsedAnswer,
    ToolCallParser,
    ToolEvent,
    gather,
    parse_answer,
)


def ids() -> itertools.count[int]:
    return itertools.count()


def whole(tool_format: ToolFormat, text: str) -> ParsedAnswer:
    counter = ids()
    return parse_answer(tool_format, text, lambda: f"call_{next(counter)}")


def streamed(tool_format: ToolFormat, pieces: list[str]) -> tuple[ParsedAnswer, list[ToolEvent]]:
    counter = ids()
    parser = ToolCallParser(tool_format, lambda: f"call_{next(counter)}")
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    return gather(events), events


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"unit": "}C"}]}}'
CASES = [
    (
        HERMES,
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": [1, {"unit": "}C"}]})],
    ),
    (
        HERMES,
        f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        '{"arguments": {}, "name": "now"}\n</tool_call>\n',
        "Let me look.",
        [("get_weather", {"city": "Paris", "days": [1, {"unit": "}C"}]}), ("now", {})],
    ),
    (HERMES, "A plain answer, with a < and a <tool too.", "A plain answer, with a < and a <tool too.", []),
    (HERMES, "<tool_call>\nnot JSON\n</tool_call> and after", "<tool_call>\nnot JSON\n</tool_call> and after", []),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", {"a": 1})]),
    (HERMES, '<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", {})]),
    (
        HERMES,
        '<tool_call>\n{"name": "doc", "arguments": {"text": "ends with </tool_call>"}}\n</tool_call> Done.',
        "Done.",
        [("doc", {"text": "ends with </tool_call>"})],
    ),
    (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", {"x": 1}), ("g", {})],
    ),
    (LLAMA3_JSON, ' {"name": "f", "parameters": {"x": "a;b"}}', None, [("f", {"x": "a;b"})]),
    (LLAMA3_JSON, "Hello {there}", "Hello {there}", []),
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "f", "arguments": {"q": "a\\"b]"}}, {"name": "g", "arguments": {}}]',
        None,
        [("f", {"q": 'a"b]'}), ("g", {})],
    ),
    (MISTRAL, "No calls here.", "No calls here.", []),
]


@pytest.mark.parametrize(("tool_format", "text", "content", "calls"), CASES)
def test_calls_and_content_are_read_whole_and_streamed_alike(
    tool_format: ToolFormat, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    answer = whole(tool_format, text)
    assert answer.content == content
    assert [(name, json.loads(arguments)) for _, name, arguments in answer.calls] == calls
    assert [call_id for call_id, _, _ in answer.calls] == [f"call_{i}" for i in range(len(calls))]
    rng = random.Random(0)
    for _ in range(20):  # any split of the text, down to a character at a time
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(tool_format, pieces)[0] == answer
    assert streamed(tool_format, list(text))[0] == answer


def test_a_call_is_named_first_then_its_arguments_come_as_they_are_written() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    _, events = streamed(HERMES, list(text))
    assert isinstance(events[0], CallStarted) and events[0].name == "get_weather"
    pieces = [e.text for e in events[1:] if isinstance(e, ArgumentsDelta)]
    assert len(pieces) > 10  # streamed character by character, not at the end
    assert "".join(pieces) == '{"city": "Paris", "days": [1, {"unit": "}C"}]}'
    assert not any(isinstance(e, ContentDelta) for e in events)


def test_text_that_might_open_a_call_is_held_back_until_known() -> None:
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hi <tool") == [ContentDelta("Hi")]
    assert parser.feed("kit") == [ContentDelta(" <toolkit")]
    assert parser.feed("\n\n") == []  # trailing blank lines are only sent if more text follows
    assert parser.finish() == []


def test_an_answer_cut_inside_a_call_keeps_what_it_has() -> None:
    answer = whole(HERMES, '<tool_call>\n{"name": "f", "arguments": {"q": 1')
    assert answer.content is None and [(n, a) for _, n, a in answer.calls] == [("f", '{"q": 1')]


def test_a_long_argument_streams_in_linear_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each piece is read once: a 20,000-character argument in 4-character pieces is not read 5,000 times."""
    content = json.dumps({"path": "a.py", "content": "x = 1\n" * 3000})
    text = '<tool_call>\n{"name": "write_file", "arguments": ' + content + "}\n</tool_call>"
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    reads = 0
    original = ObjectScanner.scan

    def counted(self: ObjectScanner, body: str) -> CallScan:
        nonlocal reads
        before = self._next
        result = original(self, body)
        reads += self._next - before
        return result

    monkeypatch.setattr(ObjectScanner, "scan", counted)
    answer, _ = streamed(HERMES, pieces)
    assert json.loads(answer.calls[0][2]) == json.loads(content)
    assert reads <= len(text)
