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

from transformers_openai.serving.text.tool_formats import ToolFormat

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


@dataclass
class _Call:
    index: int | None = None  # its index among the answer's calls, once its name is known
    sent: int = 0  # argument characters already sent


class ObjectScanner:
    """Reads one call's JSON object as its text grows, resuming where it stopped (linear in the call's length).

    Only the top level is read: the "name" value and the arguments value; nesting and strings are tracked so that
    braces inside them do not count.
    """

    def __init__(self, start: int, arguments_key: str) -> None:
        self.start = start
        self._arguments_key = arguments_key
        self._next = start  # the next character to read
        self._depth, self._in_string, self._escaped = 0, False, False
        self._phase, self._key, self._token_start, self._value_start = "key", "", 0, 0
        self._values: dict[str, str] = {}
        self.closed = False
        self.end = start  # after the closing brace, once closed

    def scan(self, body: str) -> CallScan:
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        phase, key, token_start, value_start = self._phase, self._key, self._token_start, self._value_start
        values = self._values
        j = self._next
        while j < len(body) and not self.closed:
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
            elif c == '"':
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
                    self.closed, self.end = True, j + 1
            elif depth == 1:
                if c == ":" and phase == "colon":
                    phase = "value_start"
                elif c == ",":
                    if phase == "value":
                        values[key] = body[value_start:j].strip()
                    phase = "key"
                elif not c.isspace() and phase == "value_start":
                    value_start, phase = j, "value"
            j += 1
        self._next = j
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        self._phase, self._key, self._token_start, self._value_start = phase, key, token_start, value_start
        return self._result(body)

    def _result(self, body: str) -> CallScan:
        scan = CallScan(closed=self.closed)
        name = self._values.get("name")
        if name is not None and name.startswith('"'):
            decoded = _decoded(name)
            scan.name = decoded if isinstance(decoded, str) else None
        raw = self._values.get(self._arguments_key)
        if raw is not None:
            decoded = _decoded(raw) if raw.startswith('"') else None
            scan.arguments = decoded if isinstance(decoded, str) else raw  # arguments sent as a JSON string
        elif self._phase == "value" and self._key == self._arguments_key and body[self._value_start] in "{[":
            scan.arguments, scan.partial = body[self._value_start : self._next], True
        return scan


def _decoded(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class RegionScanner:
    """The call objects of a region as its text grows, up to the first text that is neither a call nor a separator."""

    def __init__(self, arguments_key: str) -> None:
        self._arguments_key = arguments_key
        self._closed: list[CallScan] = []  # the calls read to their end: final
        self._open: ObjectScanner | None = None
        self._after = 0  # where the next call may begin

    @property
    def outside_calls(self) -> int | None:
        """Where the text after the calls read so far begins; None while a call is still open."""
        return self._after if self._open is None else None

    def scan(self, body: str) -> list[CallScan]:
        """`body` is the region's whole text so far (it only grows)."""
        scans = list(self._closed)
        while True:
            if self._open is None:
                i = self._after
                while i < len(body) and body[i] in _SEPARATORS:
                    i += 1
                if i >= len(body) or body[i] != "{":
                    return scans
                self._open = ObjectScanner(i, self._arguments_key)
            scan = self._open.scan(body)
            scans.append(scan)
            if not scan.closed:
                return scans
            self._closed.append(scan)
            self._after, self._open = self._open.end, None


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
        self._scanner = RegionScanner(tool_format.arguments_key)
        self._started = 0  # calls named so far, over all regions
        self._blank = ""  # whitespace after the content sent: sent only if more content follows
        self._content_sent = False
        self._events: list[ToolEvent] = []

    @property
    def called(self) -> bool:
        """Whether a call has been read (its name sent)."""
        return self._started > 0

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
        self._calls, self._scanner = [], RegionScanner(self._format.arguments_key)

    def _in_calls(self, final: bool) -> None:
        region = self._text[self._region :]
        scans = self._scanner.scan(region)
        end, outside = self._format.end, self._scanner.outside_calls
        # The end marker counts outside the calls only: inside, it may be part of an argument's text.
        closed_at = region.find(end, outside) if end and outside is not None else -1
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
        """Content without the blank lines around calls: leading and trailing whitespace of the answer's text
        is dropped, whitespace between its pieces kept."""
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body) :]
        if not self._content_sent:
            body = body.lstrip()
        if body:
            self._events.append(ContentDelta(body))
            self._content_sent = True


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
