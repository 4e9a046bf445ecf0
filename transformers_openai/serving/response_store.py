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


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # 0: nothing is stored
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
