"""The responses kept for GET /v1/responses/{id} and `previous_response_id`: a bounded store, least recently used
evicted first, in this process's memory only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from transformers_openai.protocol import ChatMessage
from transformers_openai.protocol.responses import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # The conversation up to and including this response's output, as chat messages (without instructions,
    # which OpenAI does not carry over to the next response).
    conversation: tuple[ChatMessage, ...]


# What the stored responses may take together, as the characters of their JSON (a long conversation, which each
# entry holds whole, counts in every entry that holds it): a count alone would let 1,000 long-context chats take
# gigabytes.
DEFAULT_MAX_CHARS = 256 * 2**20


class ResponseStore:
    """At most `capacity` responses and `max_chars` characters of them; the least recently used go first."""

    def __init__(self, capacity: int, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.capacity = capacity  # 0: nothing is stored
        self.max_chars = max_chars
        self.chars = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        size = len(entry.response.model_dump_json()) + sum(len(m.model_dump_json()) for m in entry.conversation)
        if size > self.max_chars:
            return  # larger than the whole store: kept nowhere rather than emptying it
        self.delete(entry.response.id)
        self._entries[entry.response.id] = (entry, size)
        self.chars += size
        while len(self._entries) > self.capacity or self.chars > self.max_chars:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.chars -= evicted

    def get(self, response_id: str) -> StoredResponse | None:
        found = self._entries.get(response_id)
        if found is None:
            return None
        self._entries.move_to_end(response_id)
        return found[0]

    def delete(self, response_id: str) -> bool:
        found = self._entries.pop(response_id, None)
        if found is not None:
            self.chars -= found[1]
        return found is not None
