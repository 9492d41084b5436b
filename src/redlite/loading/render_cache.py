"""The rendered prompts of the last few chat requests, by their exact input.

A regenerate, a retry or a second client sends the same conversation again; rendering it
through the chat template, tokenizing it and finding its message boundaries is linear in the
conversation (milliseconds at tens of thousands of tokens). :class:`RenderCache` keeps the
:class:`~redlite.core.tokenizer.RenderedPrompt` of recent inputs: the same messages and template
arguments give back the same object (the template and the tokenizer are pure functions of them).

The key is the input as nested tuples, each number and boolean with its type (so ``1``,
``True`` and ``1.0`` stay apart, and a float by its ``repr``: ``-0.0`` is not ``0.0``), lists,
tuples and dicts tagged (key order kept): two inputs have equal keys only when a template could
not tell them apart. Strings are compared as they are (their hash is computed once per string).
Inputs holding anything but ``dict``, ``list``, ``tuple``, ``str``, ``int``, ``float``, ``bool``
and ``None`` are not cached.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable


class _NotPlain(Exception):
    pass


def _key(value: Any) -> Any:
    kind = type(value)
    if kind is str or value is None:
        return value
    if kind is bool or kind is int:
        return kind, value
    if kind is float:
        return float, repr(value)
    if kind is dict:
        if not all(type(k) is str for k in value):
            raise _NotPlain
        return "{", tuple((k, _key(v)) for k, v in value.items())
    if kind is list or kind is tuple:
        return "[" if kind is list else "(", tuple(_key(v) for v in value)
    raise _NotPlain


def input_key(value: Any) -> Any:
    """``value`` as a hashable key that tells apart what a template could (see the module
    docstring); None when it holds something else than plain values."""
    try:
        return _key(value)
    except _NotPlain:
        return None


class RenderCache:
    """Rendered prompts by input, least recently used out past ``max_entries`` or ``max_chars``
    of rendered text (thread-safe). Callers must not change a returned prompt's lists."""

    def __init__(self, max_entries: int = 8, max_chars: int = 8 << 20) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get_or_render(self, messages: list, extra: Any, render: Callable[[], Any]) -> Any:
        """The prompt cached for ``(messages, extra)`` (``extra``: the template arguments and
        whatever else the rendering depends on), else ``render()`` (kept when it returns;
        exceptions pass through, nothing is kept)."""
        try:
            key = _key((messages, extra))
        except _NotPlain:
            key = None
        if key is not None:
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    return hit
        prompt = render()
        size = len(getattr(prompt, "text", ""))
        if key is not None and size <= self.max_chars:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = prompt
                    self._chars += size
                while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                    _, old = self._entries.popitem(last=False)
                    self._chars -= len(getattr(old, "text", ""))
        return prompt

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._chars = 0
