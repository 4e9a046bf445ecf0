"""The responses kept for GET /v1/responses/{id} and `previous_response_id`: a bounded store, least recently used
evicted first, in this process's memory only, each response visible only to the API key that created it."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import BaseModel

from transformers_openai.protocol import ChatMessage
from transformers_openai.protocol.responses import ResponseObject


def owner_of_key(api_key: str) -> str:
    """What a stored response keeps of the API key that created it: a digest, never the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # The conversation up to and including this response's output, as chat messages (without instructions,
    # which OpenAI does not carry over to the next response).
    conversation: tuple[ChatMessage, ...]
    # `owner_of_key` of the API key that created it; None on a server that takes no keys (anyone sees it).
    owner: str | None = None


# What the stored responses may take together, as the UTF-8 bytes of their JSON (a long conversation, which each
# entry holds whole, counts in every entry that holds it): a count alone would let 1,000 long-context chats take
# gigabytes.
DEFAULT_MAX_BYTES = 256 * 2**20


def _json_bytes(model: BaseModel) -> int:
    return len(model.__pydantic_serializer__.to_json(model))


def stored_bytes(entry: StoredResponse) -> int:
    """What `entry` counts against the store's bytes: its response and its conversation as UTF-8 JSON."""
    return _json_bytes(entry.response) + sum(_json_bytes(message) for message in entry.conversation)


class ResponseStore:
    """At most `capacity` responses and `max_bytes` bytes of them; the least recently used go first.

    `get` and `delete` take the asking key's owner: another key's response is answered as one that does not exist,
    and its place in the eviction order does not move."""

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.capacity = capacity  # 0: nothing is stored
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        size = stored_bytes(entry)
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere rather than emptying it
        self._drop(entry.response.id)
        self._entries[entry.response.id] = (entry, size)
        self.bytes += size
        while len(self._entries) > self.capacity or self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        found = self._entries.get(response_id)
        if found is None or found[0].owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return found[0]

    def delete(self, response_id: str, owner: str | None) -> bool:
        found = self._entries.get(response_id)
        if found is None or found[0].owner != owner:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        found = self._entries.pop(response_id, None)
        if found is not None:
            self.bytes -= found[1]
