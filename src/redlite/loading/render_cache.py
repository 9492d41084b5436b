"""The rendered prompts of the last few chat requests, by their exact input.

A regenerate, a retry or a second client sends the same conversation again; rendering it
through the chat template, tokenizing it and finding its message boundaries is linear in the
conversation (milliseconds at tens of thousands of tokens). :class:`RenderCache` keeps the
:class:`~redlite.core.tokenizer.RenderedPrompt` of recent inputs: the same messages and template
arguments give back the same object (the template and the tokenizer are pure functions of them).

The key is the ``repr`` of the input when it holds only built-in JSON-like values (``dict``,
``list``, ``tuple``, ``str``, ``int``, ``float``, ``bool``, ``None``), whose ``repr`` tells any
two apart that a template could tell apart (a tuple from a list, ``1`` from ``True`` and
``1.0``, key order); anything else is not cached.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if kind in (list, tuple):
        return all(_plain(v) for v in value)
    return False


class RenderCache:
    """Rendered prompts by input, least recently used out past ``max_entries`` or ``max_chars``
    of keys (thread-safe). Callers must not change a returned prompt's lists."""

    def __init__(self, max_entries: int = 8, max_chars: int = 32 << 20) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get_or_render(self, messages: list, extra: Any, render: Callable[[], Any]) -> Any:
        """The prompt cached for ``(messages, extra)`` (``extra``: the template arguments and
        whatever else the rendering depends on), else ``render()`` (kept when it returns;
        exceptions pass through, nothing is kept)."""
        key = repr((messages, extra)) if _plain(messages) and _plain(extra) else None
        if key is not None:
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    return hit
        prompt = render()
        if key is not None and len(key) <= self.max_chars:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = prompt
                    self._chars += len(key)
                while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                    old, _ = self._entries.popitem(last=False)
                    self._chars -= len(old)
        return prompt

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._chars = 0
