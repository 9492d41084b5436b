"""Streaming parser of one Qwen3-Coder / Qwen3.5 tool call (torch-free).

Format (Qwen3-Coder's chat template)::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Rules (the issue "Agents can drive redlite", output parsing):

* One leading and one trailing newline of a value are markup, not value.
* A value is converted to the type the tool's JSON schema gives its parameter: ``string`` stays
  text (streamed as a JSON string piece by piece); ``integer`` / ``number`` / ``boolean`` /
  ``null`` / ``object`` / ``array`` are parsed as JSON when they can be (else kept as a string)
  and emitted whole when the value ends. A parameter missing from the schema is a string.
* A closing tag inside a value (file contents) does not end it unless markup follows it:
  ``</parameter>`` ends a value only when, after optional whitespace, ``<parameter=``,
  ``</function>``, ``</tool_call>`` or the end of output follows; ``</function>`` (a missing
  final ``</parameter>``) only before ``</tool_call>``, ``<tool_call>`` or the end;
  ``</tool_call>`` (both missing) only before ``<tool_call>`` or the end.
* A malformed parameter name (empty, or holding ``<``, ``>``, ``=`` or a newline, or longer
  than 256 characters) drops that parameter and its value (logged), keeping the call valid.
* The body may start at a bare ``<function=`` (no ``<tool_call>``); a missing ``</tool_call>``
  after ``</function>`` is tolerated.

The arguments stream as JSON text: ``{`` with the call start, then ``"KEY": `` and the value's
pieces, then ``}`` when the function closes; they concatenate to a JSON object.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Callable

from redlite.core.chat import OutputEvent, ToolCallDelta

log = logging.getLogger("redlite.tools")

FUNCTION = "<function="
PARAMETER = "<parameter="
END_PARAMETER = "</parameter>"
END_FUNCTION = "</function>"
OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BAD_NAME = re.compile(r"[<>=\n]")
_MAX_NAME = 256
# what may follow each closing tag (after whitespace) for it to be markup inside a value
_FOLLOWERS = {END_PARAMETER: (PARAMETER, END_FUNCTION, CLOSE), END_FUNCTION: (CLOSE, OPEN),
              CLOSE: (OPEN,)}


def _json_type(schema: dict | None) -> str:
    kind = (schema or {}).get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return kind if isinstance(kind, str) else "string"


def convert_value(text: str, schema: dict | None) -> str:
    """JSON text of a parameter value converted to its schema type (see module docstring)."""
    kind = _json_type(schema)
    if kind != "string":
        try:
            value = json.loads(text)
        except ValueError:
            value = text.strip().lower() == "true" if kind == "boolean" and text.strip().lower() in (
                "true", "false") else None
            if value is None:
                return json.dumps(text, ensure_ascii=False)
        ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}
        if ok.get(kind, lambda v: True)(value):
            return json.dumps(value, ensure_ascii=False)
    return json.dumps(text, ensure_ascii=False)


class XmlCallParser:
    """One call (see module docstring). ``feed(text)`` returns ``(events, rest)``; rest is None
    while the call continues, else the text after it. ``finish()`` ends the output."""

    def __init__(self, index: int, new_id: Callable[[], str], schemas: dict[str, dict],
                 opening: str = OPEN) -> None:
        self.index = index
        self._new_id = new_id
        self._schemas = schemas
        self._opening = opening
        self._bare = opening != OPEN  # started at <function= without <tool_call>
        self._buf = ""
        self._state = "pre" if not self._bare else "fname"
        self.raw = ""
        self.name: str | None = None
        self.started = False
        self.complete = False
        self._nparams = 0
        self._pname: str | None = None
        self._skip = False
        self._value = ""        # value text not yet emitted (held newline / terminator prefix)
        self._value_all = ""    # whole value (typed values are emitted at their end)
        self._value_first = True
        self.arguments = ""

    def _arg(self, events: list[OutputEvent], piece: str) -> None:
        if piece:
            self.arguments += piece
            events.append(OutputEvent("tool_call", ToolCallDelta(self.index, piece)))

    def _string_param(self) -> bool:
        schema = self._schemas.get(self.name or "", {}).get("properties", {}).get(self._pname or "")
        return _json_type(schema) == "string"

    # --- states -------------------------------------------------------------------------------

    def _step(self, events: list[OutputEvent], eos: bool) -> str | None | bool:
        """Advance once. True: progress made; False: need more text; str: the call ended with
        that rest."""
        buf = self._buf
        if self._state in ("pre", "between", "after"):
            stripped = buf.lstrip()
            want = {"pre": (FUNCTION,), "between": (PARAMETER, END_FUNCTION),
                    "after": (CLOSE,)}[self._state]
            for tag in want:
                if stripped.startswith(tag):
                    self._buf = stripped[len(tag):]
                    return self._on_tag(events, tag)
            if not stripped or (any(t.startswith(stripped) for t in want) and not eos):
                return False if not eos else self._end(events, "")
            if self._state == "after":  # no </tool_call>: what follows is not ours
                return self._end(events, buf)
            if self._state == "pre":
                return self._end(events, buf, malformed=True)
            junk = stripped.find("<", 1)  # text between parameters: skipped
            self._buf = stripped[junk:] if junk > 0 else ""
            return True
        if self._state in ("fname", "pname"):
            close = buf.find(">")
            if close < 0:
                if len(buf) > _MAX_NAME or "\n" in buf or eos:
                    return self._bad_name(events, buf)
                return False
            name, self._buf = buf[:close].strip(), buf[close + 1:]
            if not name or len(name) > _MAX_NAME or _BAD_NAME.search(name):
                return self._bad_name(events, name)
            if self._state == "fname":
                self.name, self.started, self._state = name, True, "between"
                events.append(OutputEvent("tool_call", ToolCallDelta(self.index, "", self._new_id(), name)))
                self._arg(events, "{")
            else:
                self._start_value(events, name)
            return True
        return self._value_step(events, eos)

    def _on_tag(self, events: list[OutputEvent], tag: str):
        if tag == FUNCTION:
            self._state = "fname"
        elif tag == PARAMETER:
            self._state = "pname"
        elif tag == END_FUNCTION:
            return self._close_function(events)
        elif tag == CLOSE:
            return self._end(events, self._buf)
        return True

    def _bad_name(self, events: list[OutputEvent], name: str):
        log.warning("tool call: malformed %s name %r", "function" if self._state == "fname" else
                    "parameter", name[:40])
        if self._state == "fname":
            return self._end(events, self._buf, malformed=True)
        self._skip, self._pname = True, None
        self._start_value(events, None)
        return True

    def _start_value(self, events: list[OutputEvent], name: str | None) -> None:
        self._state, self._pname = "value", name
        self._value, self._value_all, self._value_first = "", "", True
        self._skip = name is None
        if name is not None:
            self._arg(events, (", " if self._nparams else "") + json.dumps(name, ensure_ascii=False) + ": ")
            self._nparams += 1
            if self._string_param():
                self._arg(events, '"')

    def _value_step(self, events: list[OutputEvent], eos: bool):
        buf = self._buf
        search = 0
        while True:
            at = buf.find("</", search)
            if at < 0:
                hold = len(buf) - 1 if buf.endswith("<") and not eos else len(buf)
                self._value_text(events, buf[:hold], final=False)
                self._buf = buf[hold:]
                return False
            tag = next((t for t in _FOLLOWERS if buf.startswith(t, at)), None)
            if tag is None:
                if any(t.startswith(buf[at:]) for t in _FOLLOWERS) and not eos:
                    self._value_text(events, buf[:at], final=False)
                    self._buf = buf[at:]
                    return False
                search = at + 2
                continue
            after = buf[at + len(tag):].lstrip()
            followers = _FOLLOWERS[tag]
            if (not after and eos) or any(after.startswith(f) for f in followers):
                self._value_text(events, buf[:at], final=True)
                self._buf = buf[at + len(tag):]
                self._end_value(events)
                if tag == END_PARAMETER:
                    self._state = "between"
                    return True
                done = self._close_function(events)
                if tag == CLOSE:
                    return self._end(events, self._buf)
                return done
            if not eos and any(f.startswith(after) for f in followers):
                self._value_text(events, buf[:at], final=False)
                self._buf = buf[at:]
                return False  # undecided: wait for what follows the closing tag
            search = at + len(tag)

    def _value_text(self, events: list[OutputEvent], text: str, final: bool) -> None:
        """Add value text; hold one trailing newline (it is markup if the value ends there)."""
        text = self._value + text
        if self._value_first and text:
            if text.startswith("\n"):
                text = text[1:]
            self._value_first = False
        if final and text.endswith("\n"):
            text = text[:-1]
        self._value = ""
        if not final and text.endswith("\n"):
            text, self._value = text[:-1], "\n"
        self._value_all += text
        if not self._skip and self._string_param():
            self._arg(events, json.dumps(text, ensure_ascii=False)[1:-1])

    def _end_value(self, events: list[OutputEvent]) -> None:
        if self._skip:
            pass
        elif self._string_param():
            self._arg(events, '"')
        else:
            schema = self._schemas.get(self.name or "", {}).get("properties", {}).get(self._pname or "")
            self._arg(events, convert_value(self._value_all, schema))
        self._skip, self._pname = False, None

    def _close_function(self, events: list[OutputEvent]):
        self._arg(events, "}")
        self.complete = True
        self._state = "after"
        return True

    def _end(self, events: list[OutputEvent], rest: str, malformed: bool = False) -> str:
        if malformed and not self.started:
            events.append(OutputEvent("content", self._opening))
            return self.raw
        return rest

    # --- interface ----------------------------------------------------------------------------

    def _run(self, events: list[OutputEvent], eos: bool) -> str | None:
        while True:
            result = self._step(events, eos)
            if isinstance(result, str):
                return result
            if result is False:
                return "" if eos else None

    def feed(self, text: str) -> tuple[list[OutputEvent], str | None]:
        events: list[OutputEvent] = []
        self.raw += text
        self._buf += text
        return events, self._run(events, eos=False)

    def finish(self) -> list[OutputEvent]:
        """End of output: an open value and function are closed (missing closing tags at the
        end are tolerated); a call whose name never completed is returned as content."""
        events: list[OutputEvent] = []
        rest = self._run(events, eos=True)
        if self.started and not self.complete:
            if self._state == "value":
                self._value_text(events, "", final=True)
                self._end_value(events)
            self._close_function(events)
        if rest and not self.started:
            events.append(OutputEvent("content", rest))
        return events
