"""Stored responses for ``previous_response_id``, ``GET /v1/responses/{id}`` and its
``input_items``.

Each stored response keeps its conversation as converted messages (the history it continued,
its input and its output as one assistant message; without ``instructions``, which OpenAI does
not carry over), its response object and its input items as ``input_items`` lists them. A
request naming it renders the same history again, so the generator finds the conversation in its
held or parked state and prefills only the new input. The store lives in memory, bounded by
``max_count`` entries and ``max_bytes`` (the JSON size of the entries, items included); adding
past a bound evicts the oldest entries. Thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading


@dataclasses.dataclass
class StoredResponse:
    messages: list[dict]
    response: dict
    nbytes: int
    input_items: list[dict] = dataclasses.field(default_factory=list)


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

    def put(self, response_id: str, messages: list[dict], response: dict,
            input_items: list[dict] | None = None) -> bool:
        """Store a response (with its listed ``input_items``); False (nothing stored) when it
        alone exceeds ``max_bytes``."""
        input_items = input_items or []
        nbytes = len(json.dumps([messages, response, input_items],
                                ensure_ascii=False).encode("utf-8"))
        if nbytes > self.max_bytes or self.max_count <= 0:
            return False
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[response_id] = StoredResponse(messages, response, nbytes, input_items)
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
