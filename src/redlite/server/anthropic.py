"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (the
prompt's tokens, generating nothing; a prompt past the context is counted, not refused).

An adapter (issue 14): the body is converted into a :class:`~redlite.core.chat.ChatRequest`
(:mod:`redlite.server.anthropic_convert`), run by the chat service like a chat completion, and
its output rendered as a Messages object or Anthropic's event stream
(:mod:`redlite.server.anthropic_events`). Headers: ``x-api-key`` and ``anthropic-version`` are
accepted; ``anthropic-beta`` values are ignored, never rejected. The session key is Claude
Code's ``x-claude-code-session-id`` header, else ``metadata.user_id``. Errors are raised as
:class:`APIError` and answered in Anthropic's shape ``{"type": "error", "error": {"type",
"message"}, "request_id"}`` with the matching HTTP status by the app's handler (the surface is
chosen by path, :mod:`redlite.server.errors`), and inside a stream as an ``error`` event.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from redlite.server.access import context_of
from redlite.server.anthropic_convert import to_chat_request
from redlite.server.anthropic_events import MessageStream, message_body
from redlite.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from redlite.server.chat_bridge import ChatRun, count_prompt_tokens
from redlite.server.errors import APIError
from redlite.server.wire_common import sse_event
from redlite.server.session_key import body_session_value, session_key_of

log = logging.getLogger("redlite.server.anthropic")

async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated as ``model``: the server's one body parser (415 unless JSON,
    400 naming the first bad field)."""
    from redlite.server.app import _parse  # app imports this module: import at call time

    return await _parse(request, model)


def _session_key(request: Request, body: MessagesRequest) -> str | None:
    """The session headers (:mod:`redlite.server.session_key`), else ``metadata.user_id``."""
    return session_key_of(request.headers,
                          body_session_value("anthropic", {"metadata": body.metadata}))


async def _stream(run: ChatRun, stream: MessageStream, request_id: str) -> AsyncIterator[bytes]:
    """The SSE body. ``message_start`` waits for the run's first piece or tick, by which time
    the engine has planned the request (unless it is still queued), so its usage already splits
    the prompt into reused and prefilled tokens."""
    started = False
    try:
        try:
            async for piece in run:
                if not started:
                    started = True
                    for event in stream.start(run.reused_tokens):
                        yield sse_event(event)
                if piece is None:
                    yield sse_event(stream.ping())
                    continue
                for event in stream.feed(piece):
                    yield sse_event(event)
        except APIError as error:
            yield sse_event(error.body("anthropic", request_id))
            return
        if not started:
            for event in stream.start(run.reused_tokens):
                yield sse_event(event)
        for event in stream.finish(run.output, run.usage):
            yield sse_event(event)
    finally:
        run.close()


def mount_anthropic_routes(app: FastAPI, state) -> None:
    """Add the Messages routes to ``app`` (``state``: the server's ServerState)."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await parse_body(request, MessagesRequest)
        chat = await asyncio.to_thread(to_chat_request, body, _session_key(request, body))
        context = context_of(request.scope)
        chat.request_id = f"msg_{context.hex}"
        run = ChatRun(state, request, chat, tick_s=state.ping_interval_s)
        try:
            await run.start()
        except APIError as error:  # Anthropic's errors carry no param: the message names it
            if error.param == "response_format":
                error.message = f"output_config.format: {error.message}"
            raise
        if body.stream:
            stream = MessageStream(chat.request_id, state.model_id, run.prompt_tokens)
            return StreamingResponse(_stream(run, stream, context.request_id),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await run.finish()
        return message_body(chat.request_id, state.model_id, run.output, run.usage)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        body = await parse_body(request, CountTokensRequest)
        chat = await asyncio.to_thread(to_chat_request, body)
        return {"input_tokens": await count_prompt_tokens(state, chat)}
