"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``.

Each stored response keeps its conversation as converted messages (the history it continued,
its input and its output as one assistant message; without ``instructions``, which OpenAI does
not carry over) and its response object. A request naming it renders the same history again, so
the generator finds the conversation in its held or parked state and prefills only the new
input. The store lives in memory, bounded by ``max_count`` entries and ``max_bytes`` (the JSON
size of the entries); adding past a bound evicts the oldest entries. Thread-safe.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass


@dataclass
class StoredResponse:
    messages: list[dict]
    response: dict
    nbytes: int


class ResponseStore:
    """An LRU-by-insertion store of responses (see module docstring)."""

    def __init__(self, max_count: int = 1024, max_bytes: int = 256 << 20) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, messages: list[dict], response: dict) -> bool:
        """Store a response; False (nothing stored) when it alone exceeds ``max_bytes``."""
        nbytes = len(json.dumps([messages, response], ensure_ascii=False).encode("utf-8"))
        if nbytes > self.max_bytes or self.max_count <= 0:
            return False
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[response_id] = StoredResponse(messages, response, nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes
            return entry is not None
