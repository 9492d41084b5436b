"""Streaming parser of one JSON tool call: hermes (``<tool_call>{json}</tool_call>``) and Llama 3
(``{"name": ..., "parameters": ...}``) bodies (torch-free).

The body is ``{"name": NAME, "arguments": {...}}`` (``parameters`` is accepted for
``arguments``, Llama 3's name; keys in any order). A small JSON lexer tracks depth, strings and
escapes character by character, so a ``</tool_call>`` inside a string value never ends the call.
The call's start event (name) is emitted once the name is known and the arguments value has
begun; the arguments of an object value stream as their raw JSON text, piece by piece as they
are generated, so the pieces concatenate to the final arguments exactly. A value that is not an
object (a JSON string holding the object, as some models write) is emitted whole at its end.

Ends: hermes waits, after the object closes, for ``</tool_call>`` (or a next ``<tool_call>``,
which is left for the caller); Llama 3 ends when the object closes. A body that is not a JSON
object with a name and arguments is *malformed*: when nothing was emitted yet, its raw text is
returned as content, otherwise the call is reported incomplete (see :attr:`complete`).
"""

from __future__ import annotations

import json
from typing import Callable

from redlite.core.chat import OutputEvent, ToolCallDelta

CLOSE = "</tool_call>"
OPEN = "<tool_call>"
_ARG_KEYS = ("arguments", "parameters")


class JsonCallParser:
    """One call's body. ``feed(text)`` returns ``(events, rest)``: rest is None while the call
    continues, else the text after the call (given back to the caller's lexer). ``finish()`` is
    called at the end of output instead of further feeds."""

    def __init__(self, index: int, new_id: Callable[[], str], close_tag: bool = True,
                 opening: str = OPEN) -> None:
        self.index = index
        self._new_id = new_id
        self._close_tag = close_tag
        self._opening = opening  # raw markup given back as content when malformed
        self.raw = ""            # body text consumed so far
        self._pos = 0            # next char of raw to lex
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._str_start = -1
        self._expect_key = True
        self._key: str | None = None
        self._value_start = -1
        self.name: str | None = None
        self._args_start = -1    # index in raw of the arguments value's first char
        self._args_sent = 0      # chars of the arguments value already emitted (object values)
        self._args_done = False
        self._args_text: str | None = None
        self.started = False     # call start emitted
        self.closed = False      # the JSON object closed
        self.complete = False
        self.malformed = False
        self._broken_at = -1

    # --- lexing -------------------------------------------------------------------------------

    def _lex(self, events: list[OutputEvent]) -> None:
        raw = self.raw
        while self._pos < len(raw) and not self.closed and not self.malformed:
            i, ch = self._pos, raw[self._pos]
            self._pos += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._depth == 1:
                        token = raw[self._str_start:i + 1]
                        if self._expect_key:
                            self._key = _loads(token)
                        elif self._key == "name" and self.name is None:
                            self.name = _loads(token) if isinstance(_loads(token), str) else None
                continue
            if self._depth == 0:
                if ch == "{":
                    self._depth = 1
                elif not ch.isspace():
                    self.malformed = True
                continue
            if ch == '"':
                self._in_str = True
                self._str_start = i
            elif ch == "<" and self._close_tag:
                if raw.startswith(CLOSE, i):
                    self._broken_at = i  # a closing tag outside any string: a broken body
                    self.malformed = True
                elif CLOSE.startswith(raw[i:]):
                    self._pos = i  # could be the closing tag: wait for more text
                    break
            elif ch in "{[":
                if self._depth == 1 and self._key in _ARG_KEYS and self._args_start < 0 and ch == "{":
                    self._args_start = i
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1 and self._args_start >= 0 and not self._args_done \
                        and self._key in _ARG_KEYS:
                    self._end_args(i + 1)
                elif self._depth == 0:
                    self._end_value(i)
                    self.closed = True
            elif self._depth == 1 and ch == ":":
                self._expect_key = False
                self._value_start = i + 1
            elif self._depth == 1 and ch == ",":
                self._end_value(i)
                self._expect_key = True
            self._emit(events)
        self._emit(events)

    def _end_value(self, end: int) -> None:
        if self._key in _ARG_KEYS and self._args_text is None and self._value_start >= 0:
            text = self.raw[self._value_start:end].strip()
            value = _loads(text)
            if isinstance(value, str):
                inner = _loads(value)
                value = inner if isinstance(inner, dict) else None
            if isinstance(value, dict):
                self._args_text = text if self._args_start >= 0 else json.dumps(value, ensure_ascii=False)
        self._value_start = -1

    def _end_args(self, end: int) -> None:
        self._args_done = True
        self._args_text = self.raw[self._args_start:end]

    def _emit(self, events: list[OutputEvent]) -> None:
        if self.name is None:
            return
        if not self.started and (self._args_start >= 0 or self._args_text is not None):
            self.started = True
            events.append(OutputEvent("tool_call", ToolCallDelta(self.index, "", self._new_id(), self.name)))
        if not self.started:
            return
        if self._args_start >= 0:
            end = len(self.raw) if not self._args_done else self._args_start + len(self._args_text)
            end = min(end, self._pos)
            piece = self.raw[self._args_start + self._args_sent:end]
            if piece:
                self._args_sent += len(piece)
                events.append(OutputEvent("tool_call", ToolCallDelta(self.index, piece)))
        elif self._args_text is not None and self._args_sent == 0 and self.closed:
            self._args_sent = len(self._args_text)
            events.append(OutputEvent("tool_call", ToolCallDelta(self.index, self._args_text)))

    # --- the caller's interface ---------------------------------------------------------------

    def feed(self, text: str) -> tuple[list[OutputEvent], str | None]:
        events: list[OutputEvent] = []
        self.raw += text
        self._lex(events)
        if self.malformed:
            return self._give_up(events)
        if not self.closed:
            return events, None
        tail = self.raw[self._pos:]
        if not self._close_tag:
            return self._end(events, self._pos, tail)
        stripped = tail.lstrip()
        skipped = len(tail) - len(stripped)
        if stripped.startswith(CLOSE):
            return self._end(events, self._pos + skipped + len(CLOSE), stripped[len(CLOSE):])
        if stripped and not CLOSE.startswith(stripped[:len(CLOSE)]):
            # no closing tag: the next text (another <tool_call>, prose) is not part of the call
            return self._end(events, self._pos, tail)
        return events, None

    def _end(self, events: list[OutputEvent], consumed: int, rest: str):
        self.complete = self._valid()
        if not self.started:  # a JSON object that is no call: it was text after all
            events.append(OutputEvent("content", self._opening + self.raw[:consumed]))
        self.raw = self.raw[:consumed]
        return events, rest

    def finish(self) -> list[OutputEvent]:
        """End of output: a call whose object closed is complete (a missing closing tag is
        tolerated); otherwise it is incomplete (or returned as content if nothing was sent)."""
        if self.closed:
            self.complete = self._valid()
            return []
        events: list[OutputEvent] = []
        if not self.started:
            events.append(OutputEvent("content", self._opening + self.raw))
        return events

    def _valid(self) -> bool:
        return self.started and self._args_text is not None and isinstance(_loads(self._args_text), dict)

    def _give_up(self, events: list[OutputEvent]):
        """Malformed body. Nothing sent yet: the opening markup becomes content and the body
        goes back to the caller's lexer. Otherwise the call stays incomplete and the text after
        its closing tag (if any) goes back."""
        if not self.started:
            events.append(OutputEvent("content", self._opening))
            return events, self.raw
        if self._broken_at >= 0:
            return events, self.raw[self._broken_at + len(CLOSE):]
        return events, ""

    @property
    def arguments(self) -> str:
        return self._args_text or ""


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return None
