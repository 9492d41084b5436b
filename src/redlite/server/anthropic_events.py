"""Anthropic Messages response objects and stream events from a generation's output (pure).

Non-streamed: :func:`message_body` builds ``{"id", "type": "message", "role": "assistant",
"model", "content": [thinking?, text?, tool_use*, ...], "stop_reason", "stop_sequence", "usage"}``
(blocks in generation order: text after a call follows it).

Streamed: :class:`MessageStream` turns the :class:`~redlite.core.chat.OutputEvent` sequence into
Anthropic's events, in Anthropic's order: ``message_start``; per content block
``content_block_start``, deltas (``thinking_delta``, ``text_delta``, ``input_json_delta`` with the
tool input in pieces as generated) and ``content_block_stop`` (a thinking block gets its
``signature_delta`` just before its stop); then ``message_delta`` (stop_reason, usage) and
``message_stop``. ``ping`` events may be sent at any point (while a long prefill runs). The
deltas of a stream concatenate to exactly :func:`message_body`'s content.

Usage mapping (Anthropic counts cached and uncached input separately; their sum is the prompt):
``cache_read_input_tokens`` = redlite's reused tokens, ``input_tokens`` = prompt tokens minus
reused ones (the part prefilled for this request), ``cache_creation_input_tokens`` = 0 (redlite
keeps every prompt's state without a separate cache write), ``output_tokens`` = generated tokens.

Thinking ``signature``: ``"redlite-"`` + the first 32 hex digits of the SHA-256 of the thinking
text. Clients must send it back unchanged; redlite does not verify it (the text is what counts).
"""

from __future__ import annotations

import hashlib

from redlite.core.chat import ChatOutput, OutputEvent, ToolCallDelta
from redlite.server.wire_common import Usage, arguments_object


def thinking_signature(thinking: str) -> str:
    """The ``signature`` of a thinking block (see module docstring)."""
    return "redlite-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def usage_object(usage: Usage) -> dict:
    """Anthropic ``usage`` (see the module docstring for the mapping)."""
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason_of(output: ChatOutput) -> str:
    """``tool_use``, ``max_tokens``, ``model_context_window_exceeded`` (cut by the full context
    before ``max_tokens``), ``stop_sequence`` or ``end_turn``."""
    if output.tool_calls and output.finish_reason != "length":
        return "tool_use"
    if output.finish_reason == "length":
        return "model_context_window_exceeded" if output.context_full else "max_tokens"
    if output.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def content_blocks(output: ChatOutput) -> list[dict]:
    """The ``content`` list, one block per part of the answer in generation order (thinking,
    text, tool_use; text after a call is a block after it, as the stream sends it); an empty
    answer is ``[]``, as Anthropic's API returns it (an empty text block would be refused when
    the client sends the message back)."""
    blocks: list[dict] = []
    for part in output.ordered_parts():
        if part.kind == "reasoning":
            blocks.append({"type": "thinking", "thinking": part.text,
                           "signature": thinking_signature(part.text)})
        elif part.kind == "content":
            blocks.append({"type": "text", "text": part.text})
        else:
            call = part.call
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                           "input": arguments_object(call.arguments)})
    return blocks


def _envelope(message_id: str, model: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


def message_body(message_id: str, model: str, output: ChatOutput, usage: Usage) -> dict:
    """The non-streamed Messages response."""
    return {**_envelope(message_id, model), "content": content_blocks(output),
            "stop_reason": stop_reason_of(output),
            "stop_sequence": output.stop_sequence if output.finish_reason != "length" else None,
            "usage": usage_object(usage)}


class MessageStream:
    """Builds the event dicts of one streamed message; call :meth:`start`, :meth:`feed` for each
    OutputEvent, then :meth:`finish`. Each method returns the events to send, in order."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self._index = -1
        self._open: str | None = None  # "thinking", "text", "tool_use"
        self._thinking: list[str] = []
        self._tool_blocks: dict[int, int] = {}  # tool call index -> block index

    def start(self, cached_tokens: int | None = None) -> list[dict]:
        """``message_start``; its input usage splits the prompt by ``cached_tokens`` (the reused
        tokens, once the engine has planned the request; None: not known yet, all uncached)."""
        message = {**_envelope(self.message_id, self.model), "content": [], "stop_reason": None,
                   "stop_sequence": None,
                   "usage": usage_object(Usage(prompt_tokens=self.prompt_tokens,
                                               cached_tokens=cached_tokens or 0))}
        return [{"type": "message_start", "message": message}]

    @staticmethod
    def ping() -> dict:
        return {"type": "ping"}

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":
            signature = thinking_signature("".join(self._thinking))
            events.append({"type": "content_block_delta", "index": self._index,
                           "delta": {"type": "signature_delta", "signature": signature}})
            self._thinking = []
        events.append({"type": "content_block_stop", "index": self._index})
        self._open = None
        return events

    def _open_block(self, kind: str, block: dict) -> list[dict]:
        events = self._close()
        self._index += 1
        self._open = kind
        events.append({"type": "content_block_start", "index": self._index, "content_block": block})
        return events

    def feed(self, event: OutputEvent) -> list[dict]:
        """The events for one piece of output."""
        if event.kind == "reasoning":
            if not event.value:
                return []
            events = [] if self._open == "thinking" else self._open_block(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(event.value)
            return events + [{"type": "content_block_delta", "index": self._index,
                              "delta": {"type": "thinking_delta", "thinking": event.value}}]
        if event.kind == "content":
            if not event.value:
                return []
            events = [] if self._open == "text" else self._open_block("text", {"type": "text", "text": ""})
            return events + [{"type": "content_block_delta", "index": self._index,
                              "delta": {"type": "text_delta", "text": event.value}}]
        delta: ToolCallDelta = event.value
        events = []
        if delta.name is not None:
            events = self._open_block("tool_use", {"type": "tool_use", "id": delta.id,
                                                   "name": delta.name, "input": {}})
            self._tool_blocks[delta.index] = self._index
        if delta.arguments:
            index = self._tool_blocks.get(delta.index, self._index)
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": delta.arguments}})
        return events

    def finish(self, output: ChatOutput, usage: Usage) -> list[dict]:
        """Close the open block; ``message_delta`` with the stop reason and the final usage;
        ``message_stop``. An empty answer has no content block at all (as :func:`content_blocks`)."""
        events = self._close()
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason_of(output),
                                 "stop_sequence": output.stop_sequence
                                 if output.finish_reason != "length" else None},
                       "usage": usage_object(usage)})
        events.append({"type": "message_stop"})
        return events
