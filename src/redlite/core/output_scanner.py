"""The one streaming scanner of generated text: stop sequences, reasoning and tool calls
(torch-free).

The decode loop pushes each decoded text piece; the scanner returns :class:`OutputEvent` s
(content, reasoning, tool-call starts and argument pieces) as soon as they are certain, and at
the end a :class:`ChatOutput`. It works like a lexer over the text:

1. Stop sequences are cut first, on the raw text in every mode, by
   :class:`redlite.core.stop.StopScanner` (earliest start wins; a tail that may still become a
   stop is held back).
2. The remaining text is split by markers: ``<think>`` / ``</think>`` (reasoning parser
   ``qwen3``), the tool-call openers of the tool format (``<tool_call>`` for ``hermes``, also a
   bare ``<function=`` for ``qwen3_coder``, a leading ``{`` for ``llama3_json``). The same
   hold-back rule applies to them: a tail that is a proper prefix of a marker is not sent until
   it completes the marker or stops matching. Inside a call, the format's parser
   (:mod:`redlite.core.json_calls`, :mod:`redlite.core.xml_calls`) takes over until the call ends.

Whitespace at segment boundaries is markup (what chat templates re-render): reasoning loses its
leading and trailing whitespace, content loses whitespace right after ``</think>`` or a call
and right before a call (an opener that begins no call is text, with its whitespace).

Equality of streaming and non-streaming: the final output is built from the very events that
were emitted, so the pieces of each kind concatenate exactly to it, whatever the chunking. The
one exception is a call cut by ``max_tokens`` (finish ``length``): its start and partial
arguments were streamed, and the final output drops it (no half call is reported as a call;
``ChatOutput.cut_call`` keeps what was streamed of it).

``max_tokens`` cutting an answer after a complete call, with only whitespace since, ends it
with ``tool_calls`` (the calls are whole; a forced call often ends on the limit's last
token); a cut call, or a held tail that would have opened one (``<tool_``), is dropped and
keeps ``length``, as does text after the last call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from redlite.core.chat import ChatOutput, OutputEvent, ToolCall, new_tool_call_id
from redlite.core.json_calls import JsonCallParser
from redlite.core.stop import StopScanner
from redlite.core.xml_calls import XmlCallParser

log = logging.getLogger("redlite.tools")

TOOL_FORMATS = ("hermes", "qwen3_coder", "llama3_json")
REASONING_FORMATS = ("qwen3", "none")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ParseOptions:
    """How one generation's text is parsed.

    tool_format: one of :data:`TOOL_FORMATS`, or None: no tool calls are parsed (no tools in
        the request, or ``tool_choice: "none"``).
    reasoning: ``qwen3`` or None.
    start_in_reasoning: the prompt already opened ``<think>`` (only ``</think>`` will appear).
    schemas: tool name -> JSON schema of its parameters (types of qwen3_coder values).
    max_calls: most calls in one answer (1 for ``parallel_tool_calls: false``); the generation
        stops when that many calls are complete, None: no limit.
    call_id_prefix: how the ids the server gives calls begin (the wire API's style: ``call_``
        for OpenAI's, ``toolu_`` for Anthropic's).

    Whatever max_calls, the generation stops at a complete call that repeats an earlier call of
    the same answer exactly (same name, same argument text): a model in a loop, not a plan
    (the repeat is reported as generated, so streamed and non-streamed answers agree).
    """

    tool_format: str | None = None
    reasoning: str | None = None
    start_in_reasoning: bool = False
    schemas: dict[str, dict] = field(default_factory=dict)
    max_calls: int | None = None
    call_id_prefix: str = "call_"


class OutputScanner:
    """See module docstring. ``push(text) -> (events, stopped)``; ``finish(reason)``."""

    def __init__(self, stops: list[str], options: ParseOptions | None = None,
                 new_id: Callable[[], str] | None = None) -> None:
        self.options = options or ParseOptions()
        self._stop = StopScanner(stops)
        prefix = self.options.call_id_prefix
        self._new_id = new_id or (lambda: new_tool_call_id(prefix))
        self._mode = "reasoning" if self.options.reasoning and self.options.start_in_reasoning else "content"
        self._pending = ""
        self._ws = ""            # trailing whitespace held in content / reasoning
        self._ws_before_opener = ""  # whitespace before a call opener: text if no call follows
        self._skip_ws = self._mode == "reasoning"
        self._seen_text = False  # any non-whitespace content or reasoning so far
        self._call = None
        self._calls: list = []
        self.output = ChatOutput()
        self._finished = False
        self._complete_calls = 0
        self._repeated = False  # a complete call repeated an earlier one: generation ends
        self._text_after_call = False  # content or reasoning text since the last complete call

    @property
    def stopped(self) -> bool:
        """True once a stop sequence matched or the last allowed call ended: generation must end."""
        return self._stop.stopped or self._call_limit_hit

    @property
    def _call_limit_hit(self) -> bool:
        limit = self.options.max_calls
        return self._repeated or (limit is not None and self._complete_calls >= limit)

    # --- markers ------------------------------------------------------------------------------

    def _markers(self) -> tuple[str, ...]:
        markers: list[str] = []
        fmt = self.options.tool_format
        if fmt in ("hermes", "qwen3_coder"):
            markers.append("<tool_call>")
        if fmt == "qwen3_coder":
            markers.append("<function=")
        if self.options.reasoning:
            if self._mode == "reasoning":
                markers.append(THINK_CLOSE)
            elif not self._seen_text:
                markers.append(THINK_OPEN)
        return tuple(markers)

    def _emit(self, kind: str, text: str, events: list[OutputEvent]) -> None:
        """Text of the current segment, whitespace rules applied."""
        if not text:
            return
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        hold = self.options.reasoning or self.options.tool_format
        body = text.rstrip() if hold else text
        if body:
            piece = self._ws + body
            self._ws = ""
            self._seen_text = self._text_after_call = True
            events.append(OutputEvent(kind, piece))
            self.output.add_text(kind, piece)
        self._ws += text[len(body):]

    def _lex(self, text: str, events: list[OutputEvent]) -> None:
        self._pending += text
        while self._pending:
            if self._call is not None:
                new, rest = self._call.feed(self._pending)
                self._pending = ""
                self._add(new, events)
                if rest is None:
                    return
                self._end_call()
                self._pending = "" if self._call_limit_hit else rest
                continue
            buf = self._pending
            if (self.options.tool_format == "llama3_json" and self._mode == "content"
                    and not self._seen_text and not self._calls):
                stripped = buf.lstrip()
                if stripped.startswith("{"):
                    self._open_call("", stripped)
                    continue
                if not stripped:
                    self._ws, self._pending = self._ws + buf, ""
                    return
            markers = self._markers()
            found = [(buf.find(m), m) for m in markers]
            # <think> opens reasoning only before any text of the answer
            found = [(at, m) for at, m in found
                     if at >= 0 and (m != THINK_OPEN or not buf[:at].strip())]
            if not found:
                hold = _held_prefix(buf, markers)
                self._emit(self._mode, buf[:len(buf) - hold], events)
                self._pending = buf[len(buf) - hold:]
                return
            at, marker = min(found)
            self._emit(self._mode, buf[:at], events)
            # markup if a call follows (content's only: a call ends reasoning)
            self._ws_before_opener = self._ws if self._mode == "content" else ""
            self._ws = ""
            rest = buf[at + len(marker):]
            if marker == THINK_OPEN:
                self._mode, self._skip_ws, self._pending = "reasoning", True, rest
            elif marker == THINK_CLOSE:
                self._mode, self._skip_ws, self._pending = "content", True, rest
            else:
                self._mode = "content"  # a call inside reasoning ends the reasoning
                self._open_call(marker, rest)

    def _open_call(self, marker: str, rest: str) -> None:
        index = len(self.output.tool_calls)
        fmt = self.options.tool_format
        if fmt == "qwen3_coder":
            # opened by a bare <function=, the parser starts at the function's name
            self._call = XmlCallParser(index, self._new_id, self.options.schemas, opening=marker)
        else:
            self._call = JsonCallParser(index, self._new_id, close_tag=fmt == "hermes", opening=marker)
        self._pending = rest

    def _add(self, new: list[OutputEvent], events: list[OutputEvent]) -> None:
        for event in new:
            if event.kind == "content":  # the opener began no call: it and its whitespace are text
                self._ws, self._ws_before_opener = self._ws_before_opener + self._ws, ""
                self._emit("content", event.value, events)
                continue
            delta = event.value
            self._ws_before_opener = ""
            if delta.name is not None:
                self.output.add_call(ToolCall(delta.id, delta.name, ""))
            else:
                self.output.tool_calls[delta.index].arguments += delta.arguments
            events.append(event)

    def _end_call(self) -> None:
        call = self._call
        self._call = None
        self._calls.append(call)
        if call.started:
            self._skip_ws, self._ws = True, ""
        if call.started and not call.complete:
            log.warning("tool call %r is malformed; dropped", call.name)
            self._drop(call.index)
        elif call.started:
            self._complete_calls += 1
            self._text_after_call = False
            calls = self.output.tool_calls
            done = calls[call.index]
            if any((c.name, c.arguments) == (done.name, done.arguments) for c in calls[:call.index]):
                log.info("tool call %r repeats an earlier call of the answer; answer ended", done.name)
                self._repeated = True

    def _drop(self, index: int) -> None:
        self.output.dropped_calls += 1
        if index < len(self.output.tool_calls):
            self.output.tool_calls[index].name = ""  # marked; removed in finish()

    # --- interface ----------------------------------------------------------------------------

    def push(self, text: str) -> tuple[list[OutputEvent], bool]:
        """Take the next decoded piece; return the events now certain and whether a stop
        sequence matched (generation must end; call :meth:`finish` next)."""
        events: list[OutputEvent] = []
        if self._finished or self.stopped:
            return events, True
        clean, stopped = self._stop.push(text)
        self._lex(clean, events)  # text after the last allowed call is dropped there
        return events, stopped or self._call_limit_hit

    def finish(self, reason: str) -> tuple[list[OutputEvent], ChatOutput]:
        """End the output. reason: ``stop`` (end of turn or stop sequence), ``length`` or
        ``cancelled``. Returns the last events and the whole :class:`ChatOutput`; its
        finish_reason is ``tool_calls`` when calls were made and the turn ended normally, or
        when ``length`` cut it after a complete call with only whitespace since (a call cut
        mid-way, or text after the last call, keeps ``length``)."""
        events: list[OutputEvent] = []
        if self._finished:
            return events, self.output
        self._finished = True
        dropped = self.output.dropped_calls
        if not self.stopped:
            self._lex(self._stop.flush(), events)
        if self._stop.stopped:
            reason = "stop"
            self.output.stop_sequence = self._stop.matched
        call = self._call
        if call is not None:
            self._call = None
            if reason == "stop":
                self._add(call.finish(), events)
                self._lex("", events)
                if call.started and not call.complete:
                    self._drop(call.index)
            elif call.started:  # cut by max_tokens: no half call is reported as a call
                cut = self.output.tool_calls[call.index]
                self.output.cut_call = ToolCall(cut.id, cut.name, cut.arguments)
                self._drop(call.index)
            else:  # a call cut before its name was complete is dropped too (it is no text either)
                self.output.dropped_calls += 1
        elif self._pending:
            openers = [m for m in self._markers() if m not in (THINK_OPEN, THINK_CLOSE)]
            if reason == "length" and any(m.startswith(self._pending) for m in openers):
                self.output.dropped_calls += 1  # a call opener cut by max_tokens: no text either
            else:
                self._emit(self._mode, self._pending, events)
            self._pending = ""
        if self._ws and self._mode == "content" and not self.output.tool_calls:
            self._seen_text = True
            events.append(OutputEvent("content", self._ws))
            self.output.add_text("content", self._ws)
        self._ws = ""
        cut = self.output.dropped_calls > dropped or self._text_after_call
        self.output.remove_dropped_calls()
        if self.output.tool_calls and (reason == "stop" or (reason == "length" and not cut)):
            reason = "tool_calls"
        self.output.finish_reason = reason
        return events, self.output


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
