"""The model's text, as it streams, split into content and tool calls (name first, then argument pieces).

One incremental parser serves both answers: a stream sends its events as they come; a whole response is
the same events gathered, so the two always agree. Calls are JSON objects with a name and arguments,
between the markers of the model's format (`ToolFormat`); text that only might be the start of a marker
is held back until it is known, and a call region with no readable call is given back as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from transformers_openai.serving.tool_formats import ToolFormat

_SEPARATORS = frozenset(" \t\r\n,;[]")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStarted | ArgumentsDelta


@dataclass
class CallScan:
    """What is readable so far of one call object."""

    name: str | None = None
    arguments: str | None = None  # the arguments' JSON text: complete, or a growing prefix when `partial`
    partial: bool = False
    closed: bool = False  # the object's closing brace was seen
    end: int = 0  # where the scan stopped in the region


@dataclass
class _Call:
    index: int | None = None  # its index among the answer's calls, once its name is known
    sent: int = 0  # argument characters already sent


def scan_object(body: str, start: int, arguments_key: str) -> CallScan:
    """Reads the JSON object at `body[start]` as far as it goes: its top-level "name" and arguments values."""
    scan = CallScan()
    depth, in_string, escaped = 0, False, False
    phase, key, token_start, value_start = "key", "", 0, 0
    values: dict[str, str] = {}
    for j in range(start, len(body)):
        c = body[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and phase == "key_text":
                    key, phase = str(_decoded(body[token_start : j + 1])), "colon"
                elif depth == 1 and phase == "value":
                    values[key], phase = body[value_start : j + 1], "comma"
            continue
        if c == '"':
            in_string = True
            if depth == 1 and phase == "key":
                token_start, phase = j, "key_text"
            elif depth == 1 and phase == "value_start":
                value_start, phase = j, "value"
        elif c in "{[":
            if depth == 1 and phase == "value_start":
                value_start, phase = j, "value"
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 1 and phase == "value":  # a container value closed
                values[key], phase = body[value_start : j + 1], "comma"
            elif depth == 0:
                if phase == "value":  # a number, true, false or null ended by the brace
                    values[key] = body[value_start:j].strip()
                scan.closed, scan.end = True, j + 1
                break
        elif depth == 1:
            if c == ":" and phase == "colon":
                phase = "value_start"
            elif c == ",":
                if phase == "value":
                    values[key] = body[value_start:j].strip()
                phase = "key"
            elif not c.isspace() and phase == "value_start":
                value_start, phase = j, "value"
    else:
        scan.end = len(body)
    name = values.get("name")
    if name is not None and name.startswith('"'):
        decoded = _decoded(name)
        scan.name = decoded if isinstance(decoded, str) else None
    if arguments_key in values:
        raw = values[arguments_key]
        decoded = _decoded(raw) if raw.startswith('"') else None
        scan.arguments = decoded if isinstance(decoded, str) else raw  # arguments sent as a JSON string
    elif phase == "value" and key == arguments_key and body[value_start] in "{[":
        scan.arguments, scan.partial = body[value_start:], True
    return scan


def _decoded(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def scan_calls(body: str, arguments_key: str) -> list[CallScan]:
    """The call objects of a region, in order, up to the first text that is not a call or a separator."""
    scans: list[CallScan] = []
    i = 0
    while i < len(body):
        if body[i] in _SEPARATORS:
            i += 1
            continue
        if body[i] != "{":
            break
        scan = scan_object(body, i, arguments_key)
        scans.append(scan)
        if not scan.closed:
            break
        i = scan.end
    return scans


class ToolCallParser:
    """Feed it the answer's text as it comes; it returns what can be told of it so far."""

    def __init__(self, tool_format: ToolFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self._format = tool_format
        self._new_id = new_id
        self._text = ""
        self._pos = 0  # text before it is settled
        self._mode = "content" if tool_format.start else "opening"
        self._opened_at = 0  # where the open call region's marker (or first brace) is
        self._region = 0  # where the open call region's body begins
        self._calls: list[_Call] = []  # the open region's calls
        self._started = 0  # calls named so far, over all regions
        self._blank = ""  # whitespace after the content sent: sent only if more content follows
        self._events: list[ToolEvent] = []

    def feed(self, text: str) -> list[ToolEvent]:
        self._text += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[ToolEvent]:
        self._advance(final=True)
        return self._take()

    def _take(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        return events

    def _advance(self, final: bool) -> None:
        while True:
            before = (self._mode, self._pos)
            if self._mode == "opening":
                self._opening(final)
            elif self._mode == "content":
                self._content(final)
            else:
                self._in_calls(final)
            if (self._mode, self._pos) == before:
                return

    def _opening(self, final: bool) -> None:
        """Formats without a start marker: the answer is calls when it opens with JSON (or the format's tag)."""
        rest = self._text[self._pos :]
        stripped = rest.lstrip()
        tag = self._format.tag
        first = len(self._text) - len(stripped)
        if tag and stripped.startswith(tag):
            self._open_region(first, first + len(tag))
        elif stripped.startswith("{"):
            self._open_region(first, first)
        elif final or (stripped and not (tag and tag.startswith(stripped))):
            self._mode = "content"

    def _content(self, final: bool) -> None:
        start = self._format.start
        rest = self._text[self._pos :]
        found = rest.find(start) if start else -1
        if found >= 0:
            self._send_content(rest[:found])
            self._open_region(self._pos + found, self._pos + found + len(start or ""))
            return
        held = 0 if final or not start else _marker_prefix(rest, start)
        self._send_content(rest[: len(rest) - held])
        self._pos += len(rest) - held
        if final:
            self._blank = ""  # trailing whitespace of an answer is dropped

    def _open_region(self, opened_at: int, body_start: int) -> None:
        self._mode, self._opened_at, self._region, self._pos = "calls", opened_at, body_start, body_start
        self._calls = []

    def _in_calls(self, final: bool) -> None:
        region = self._text[self._region :]
        end = self._format.end
        closed_at = region.find(end) if end else -1
        body = region[:closed_at] if closed_at >= 0 else region
        scans = scan_calls(body, self._format.arguments_key)
        for k, scan in enumerate(scans):
            if k == len(self._calls):
                self._calls.append(_Call())
            self._update(self._calls[k], scan, settle=closed_at >= 0 or final)
        if closed_at < 0 and not final:
            return
        region_end = self._region + (closed_at + len(end or "") if closed_at >= 0 else len(region))
        if all(call.index is None for call in self._calls):  # nothing readable: it was text after all
            self._send_content(self._text[self._opened_at : region_end])
        self._pos, self._mode = region_end, "content"

    def _update(self, call: _Call, scan: CallScan, settle: bool) -> None:
        if call.index is None and scan.name is not None:
            call.index = self._started
            self._started += 1
            self._events.append(CallStarted(call.index, self._new_id(), scan.name))
        if call.index is None:
            return
        arguments = scan.arguments
        if arguments is None and settle:
            arguments = "{}"  # a call that names no arguments takes none
        if arguments is not None and len(arguments) > call.sent:
            self._events.append(ArgumentsDelta(call.index, arguments[call.sent :]))
            call.sent = len(arguments)

    def _send_content(self, text: str) -> None:
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body) :]
        if body:
            self._events.append(ContentDelta(body))


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ParsedAnswer:
    content: str | None
    calls: list[tuple[str, str, str]]  # (id, name, arguments)


def parse_answer(tool_format: ToolFormat, text: str, new_id: Callable[[], str] = new_call_id) -> ParsedAnswer:
    """A whole answer at once: the events of one feed, gathered."""
    parser = ToolCallParser(tool_format, new_id)
    return gather(parser.feed(text) + parser.finish())


def gather(events: list[ToolEvent]) -> ParsedAnswer:
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, CallStarted):
            calls[event.index] = [event.id, event.name, ""]
        else:
            calls[event.index][2] += event.text
    return ParsedAnswer("".join(content) or None, [(c[0], c[1], c[2]) for _, c in sorted(calls.items())])
