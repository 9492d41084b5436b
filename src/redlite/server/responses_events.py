"""OpenAI Responses objects and stream events from a generation's output (pure).

Output items, in generation order: ``reasoning`` (``content: [{"type": "reasoning_text"}]``,
``summary: []``, ``encrypted_content`` when the request's ``include`` asks for
``reasoning.encrypted_content``), ``message`` (one ``output_text`` part), ``function_call``
(``call_id``, ``name``, ``arguments`` JSON text). Item ids: ``rs_`` / ``msg_`` / ``fc_`` + hex.

Stream (:class:`ResponseStream`), every event with ``sequence_number`` counting from 0:
``response.created``, ``response.in_progress``; per item ``response.output_item.added``, then
for reasoning ``response.content_part.added`` / ``response.reasoning_text.delta``* /
``response.reasoning_text.done`` / ``response.content_part.done``, for a message
``response.content_part.added`` / ``response.output_text.delta``* / ``response.output_text.done``
/ ``response.content_part.done``, for a call ``response.function_call_arguments.delta``* /
``response.function_call_arguments.done``; ``response.output_item.done``; finally
``response.completed`` (or ``response.incomplete`` when cut by ``max_output_tokens``,
``response.failed`` on an error). The deltas concatenate to the final object's texts.

Cut by ``max_output_tokens``, streamed or not: status ``incomplete``, ``incomplete_details``
``{"reason": "max_output_tokens"}``, the items so far; a call cut after its name is kept last,
a ``function_call`` with status ``incomplete`` and its arguments so far
(``ChatOutput.cut_call``), never a complete one.

Usage: ``input_tokens`` = prompt tokens, ``input_tokens_details.cached_tokens`` = redlite's reused
tokens (OpenAI counts cached tokens inside input_tokens), ``input_tokens_details.cache_write_tokens``
= 0 (redlite keeps every prompt's state without a separate cache write; the SDK requires the
field), ``output_tokens``, ``output_tokens_details.reasoning_tokens``.
"""

from __future__ import annotations

import uuid

from redlite.core.chat import ChatOutput, OutputEvent, ToolCallDelta
from redlite.server.reasoning_token import encode_reasoning
from redlite.server.wire_common import Usage


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage_object(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": min(usage.cached_tokens, usage.prompt_tokens),
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def reasoning_item(rid: str, text: str, encrypted: bool, status: str = "completed") -> dict:
    item = {"type": "reasoning", "id": rid, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}
    if encrypted:
        item["encrypted_content"] = encode_reasoning(text)
    return item


def message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(fid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": fid, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(output: ChatOutput, encrypted: bool) -> list[dict]:
    """The ``output`` list of a finished answer (non-streamed), as the stream ends it: one item
    per part of the answer in generation order (a message after a call follows it); no part at
    all is one empty message; a call cut by ``max_output_tokens`` is kept last, status
    ``incomplete``, with its arguments so far."""
    items = []
    for part in output.ordered_parts():
        if part.kind == "reasoning":
            items.append(reasoning_item(item_id("rs"), part.text, encrypted))
        elif part.kind == "content":
            items.append(message_item(item_id("msg"), part.text))
        else:
            items.append(call_item(item_id("fc"), part.call.id, part.call.name, part.call.arguments))
    if not items and output.cut_call is None:
        items.append(message_item(item_id("msg"), ""))
    if output.cut_call is not None:
        cut = output.cut_call
        items.append(call_item(item_id("fc"), cut.id, cut.name, cut.arguments, "incomplete"))
    return items


def response_object(meta: dict, status: str, output: list[dict], usage: Usage | None,
                    error: dict | None = None) -> dict:
    """A ``response`` object. meta: ``id``, ``created_at``, ``model`` and the request's echoed
    fields (``instructions``, ``tools``, ``tool_choice``, ...). status: ``in_progress``,
    ``completed``, ``incomplete`` (max_output_tokens), ``failed``."""
    body = {"id": meta["id"], "object": "response", "created_at": meta["created_at"],
            "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": meta["model"], "output": output,
            "usage": usage_object(usage) if usage is not None else None}
    for key, value in meta.items():
        body.setdefault(key, value)
    return body


def final_status(output: ChatOutput) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


class ResponseStream:
    """Builds the event dicts of one streamed response; call :meth:`start`, :meth:`feed` per
    OutputEvent, then :meth:`finish` (or :meth:`fail`). Methods return the events to send."""

    def __init__(self, meta: dict, encrypted: bool) -> None:
        self.meta, self.encrypted = meta, encrypted
        self.items: list[dict] = []   # finished items, in output order
        self._sequence = 0
        self._open: dict | None = None  # the item being streamed
        self._text: list[str] = []
        self._calls: dict[int, int] = {}  # tool call index -> output index

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict]:
        response = response_object(self.meta, "in_progress", [], None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _position(self) -> int:
        return len(self.items)

    def _close(self, status: str = "completed") -> list[dict]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = self._position()
        text = "".join(self._text)
        self._text = []
        events = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, self.encrypted)
            part = done["content"][0]
            events += [self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=text),
                       self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=part)]
        elif item["type"] == "message":
            done = message_item(item["id"], text)
            part = done["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=part)]
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text, status)
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=text))
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return events

    def _open_item(self, item: dict, part: dict | None) -> list[dict]:
        events = self._close()
        self._open = item
        index = self._position()
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=part))
        return events

    def feed(self, event: OutputEvent) -> list[dict]:
        """The events for one piece of output."""
        if event.kind in ("reasoning", "content"):
            if not event.value:
                return []
            kind = "reasoning" if event.kind == "reasoning" else "message"
            events = []
            if self._open is None or self._open["type"] != kind:
                if kind == "reasoning":
                    item = {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [],
                            "status": "in_progress"}
                    part = {"type": "reasoning_text", "text": ""}
                else:
                    item = {"type": "message", "id": item_id("msg"), "status": "in_progress",
                            "role": "assistant", "content": []}
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events = self._open_item(item, part)
            self._text.append(event.value)
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            return events + [self._event(name, item_id=self._open["id"], output_index=self._position(),
                                         content_index=0, delta=event.value, **extra)]
        delta: ToolCallDelta = event.value
        events = []
        if delta.name is not None:
            item = call_item(item_id("fc"), delta.id or "", delta.name, "", status="in_progress")
            events = self._open_item(item, None)
            self._calls[delta.index] = self._position()
        if delta.arguments and self._open is not None and self._open["type"] == "function_call":
            self._text.append(delta.arguments)
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._open["id"], output_index=self._position(),
                                      delta=delta.arguments))
        return events

    def finish(self, output: ChatOutput, usage: Usage) -> tuple[list[dict], dict]:
        """Close the open item and end with ``response.completed`` / ``response.incomplete``.
        A response with no item at all gets one empty message; a call the answer dropped (cut
        by ``max_output_tokens``: :func:`output_items` keeps it too) is closed ``incomplete``.
        Returns (events, response)."""
        kept = {call.id for call in output.tool_calls}
        cut = self._open is not None and self._open["type"] == "function_call" \
            and self._open["call_id"] not in kept
        events = self._close("incomplete" if cut else "completed")
        if not self.items:
            events += self._open_item(message_item(item_id("msg"), "", "in_progress") | {"content": []},
                                      {"type": "output_text", "text": "", "annotations": [],
                                       "logprobs": []}) + self._close()
        status = final_status(output)
        response = response_object(self.meta, status, list(self.items), usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)], response

    def fail(self, code: str, message: str, request_id: str | None = None) -> list[dict]:
        """``response.failed`` with the error (the items finished so far are kept); its
        ``error`` carries ``request_id`` when given, as the JSON errors do."""
        error = {"code": code, "message": message}
        if request_id is not None:
            error["request_id"] = request_id
        response = response_object(self.meta, "failed", list(self.items), None, error)
        return [self._event("response.failed", response=response)]
