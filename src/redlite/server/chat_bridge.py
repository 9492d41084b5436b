"""Runs a :class:`~redlite.core.chat.ChatRequest` for the Anthropic and Responses adapters.

:class:`ChatRun` renders the request, queues it on the engine worker and yields its output as
:class:`~redlite.core.chat.OutputEvent` s, with ``None`` ticks every ``tick_s`` seconds while
nothing arrives (the adapters send ``ping`` events on them during a long prefill). After the
iteration ``output`` (:class:`ChatOutput`) and ``usage`` (:class:`Usage`) are set.

Errors: :class:`APIError` from :meth:`ChatRun.start` (bad prompt, queue full, shutdown, a job
that failed before its first output) and from the iteration (a failure mid-way).

PROVISIONAL: until the chat service of issue 13 lands, rendering keeps only roles and text (tool
calls are rendered as ``<tool_call>`` JSON text) and every generated piece is ``content``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import AsyncIterator

from fastapi import Request

from redlite.core.chat import ChatOutput, ChatRequest, OutputEvent
from redlite.core.generation import GenerationRequest, GenerationResult
from redlite.core.tokenizer import RenderedPrompt
from redlite.core.worker import Event, Job, QueueFull, ShuttingDown
from redlite.server.errors import APIError, as_api_error
from redlite.server.wire_common import Usage

_render_lock = threading.Lock()


def _plain_messages(messages: list[dict]) -> list[dict]:
    out = []
    for message in messages:
        text = message.get("content") or ""
        for call in message.get("tool_calls") or []:
            text += "<tool_call>" + json.dumps({"name": call["function"]["name"],
                                                "arguments": call["function"]["arguments"]}) + "</tool_call>"
        out.append({"role": message["role"], "content": text})
    return out


async def render(state, chat: ChatRequest) -> RenderedPrompt:
    """The chat's prompt, rendered and tokenized off the event loop; 400 when the template
    rejects it or it does not fit the context."""
    def work() -> RenderedPrompt:
        with _render_lock:
            return state.tokenizer.render_chat(_plain_messages(chat.messages))
    try:
        rendered = await asyncio.to_thread(work)
    except Exception as error:
        raise APIError(400, f"cannot render the conversation: {error}", "messages") from None
    if len(rendered.token_ids) > state.max_context:
        raise APIError(400, f"the prompt has {len(rendered.token_ids)} tokens, more than the "
                       f"context of {state.max_context} tokens", "messages", "context_length_exceeded")
    return rendered


class ChatRun:
    """One chat generation on the worker (see module docstring)."""

    def __init__(self, state, http_request: Request, chat: ChatRequest, tick_s: float = 5.0) -> None:
        self.state, self.http_request, self.chat, self.tick_s = state, http_request, chat, tick_s
        self.prompt_tokens = 0
        self.output = ChatOutput()
        self.usage = Usage()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._job: Job | None = None
        self._watcher: asyncio.Future | None = None

    async def start(self) -> None:
        rendered = await render(self.state, self.chat)
        self.prompt_tokens = len(rendered.token_ids)
        generation = GenerationRequest(rendered.token_ids, self.chat.max_tokens, self.chat.sampling,
                                       self.chat.stop, rendered.message_ends, self.chat.request_id)
        loop = asyncio.get_running_loop()
        self._job = Job(generation, lambda e: loop.call_soon_threadsafe(self._events.put_nowait, e))
        try:
            self.state.worker.submit(self._job)
        except QueueFull:
            raise APIError(503, "server busy", None, "server_busy",
                           {"Retry-After": str(self.state.retry_after_s)}) from None
        except ShuttingDown:
            raise APIError(503, "server is shutting down", None, "shutting_down") from None
        self._watcher = asyncio.ensure_future(self._watch_disconnect())
        first = await self._events.get()
        if first.kind == "error":
            self.close()
            raise as_api_error(first.value)

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.http_request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return

    def cancel(self) -> None:
        if self._job is not None:
            self._job.cancel()

    def close(self) -> None:
        """Stop watching the client; cancel the job if it still runs (client gone)."""
        if self._watcher is not None:
            self._watcher.cancel()
        self.cancel()

    async def __aiter__(self) -> AsyncIterator[OutputEvent | None]:
        pieces: list[str] = []
        while True:
            try:
                event = await asyncio.wait_for(self._events.get(), self.tick_s)
            except asyncio.TimeoutError:
                yield None
                continue
            if event.kind == "text":
                if event.value:
                    pieces.append(event.value)
                    yield OutputEvent("content", event.value)
            elif event.kind == "done":
                result: GenerationResult = event.value
                if result.finish_reason == "cancelled":
                    raise APIError(503, "server is shutting down; the answer was cut off",
                                   None, "shutting_down")
                self.output = ChatOutput(content="".join(pieces), finish_reason=(
                    "length" if result.finish_reason == "length" else "stop"))
                self.usage = Usage(result.prompt_tokens, result.completion_tokens,
                                   result.cached_tokens)
                return
            elif event.kind == "error":
                raise as_api_error(event.value)
