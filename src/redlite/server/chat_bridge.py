"""Runs a :class:`~redlite.core.chat.ChatRequest` for the Anthropic and Responses adapters on the
server's chat service (:class:`redlite.server.chat_service.ChatService`, ``state.chat``).

:class:`ChatRun` starts the request and yields its output as
:class:`~redlite.core.chat.OutputEvent` s, with ``None`` ticks every ``tick_s`` seconds while
nothing arrives (the Anthropic adapter sends ``ping`` events on them during a long prefill).
After the iteration ``output`` (:class:`ChatOutput`) and ``usage`` (:class:`Usage`) are set.
The client's disconnect cancels the generation at the next token.

Errors: :class:`APIError` from :meth:`ChatRun.start` (bad request, queue full, shutdown, a job
that failed before it started) and from the iteration (a failure mid-way).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from redlite.core.chat import ChatOutput, ChatRequest, OutputEvent
from redlite.server.chat_service import ChatStream
from redlite.server.jobs import watch_disconnect
from redlite.server.wire_common import Usage


async def count_prompt_tokens(state, chat: ChatRequest) -> int:
    """Tokens of the chat's rendered prompt (as the generation would see it), generating nothing:
    any length, a prompt past the context included (the route that generates refuses it);
    every other check of the request applies."""
    prepared = await state.chat.prepare(chat, fit=False)
    return len(prepared.generation.prompt_ids)


class ChatRun:
    """One chat generation (see module docstring)."""

    def __init__(self, state, http_request: Request, chat: ChatRequest, tick_s: float = 5.0) -> None:
        self.state, self.http_request, self.chat, self.tick_s = state, http_request, chat, tick_s
        self.prompt_tokens = 0
        self.output = ChatOutput()
        self.usage = Usage()
        self._stream: ChatStream | None = None
        self._watcher: asyncio.Future | None = None

    async def start(self) -> None:
        self._stream = await self.state.chat.start(self.chat, self.http_request)
        self.prompt_tokens = self._stream.prompt_tokens
        self._watcher = asyncio.ensure_future(watch_disconnect(self.http_request, self._stream))

    @property
    def reused_tokens(self) -> int | None:
        """Prompt tokens taken from held state, once the engine has planned the request (None
        before, and before :meth:`start`)."""
        return self._stream.prepared.generation.reused if self._stream is not None else None

    async def finish(self) -> None:
        """Run to the end (a non-streamed answer: ``output`` and ``usage`` set), then close."""
        try:
            async for _ in self:
                pass
        finally:
            self.close()

    def close(self) -> None:
        """Stop watching the client; cancel the job if it still runs (client gone)."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self._stream is not None:
            self._stream.cancel()

    async def __aiter__(self) -> AsyncIterator[OutputEvent | None]:
        iterator = self._stream.__aiter__()
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=self.tick_s)
                if not done:
                    yield None
                    continue
                finished, pending = pending, None
                try:
                    event = finished.result()
                except StopAsyncIteration:
                    break
                yield event
        finally:
            if pending is not None:
                pending.cancel()
        result = self._stream.result
        self.output = result.output
        self.usage = Usage(result.usage.prompt_tokens, result.usage.completion_tokens,
                           result.usage.cached_tokens)
