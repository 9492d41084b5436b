"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

An adapter (issue 14): the body is converted into a :class:`~redlite.core.chat.ChatRequest`
(:mod:`redlite.server.anthropic_convert`), run by the chat service like a chat completion, and
its output rendered as a Messages object or Anthropic's event stream
(:mod:`redlite.server.anthropic_events`). Headers: ``x-api-key`` and ``anthropic-version`` are
accepted; ``anthropic-beta`` values are ignored, never rejected. The session key is Claude
Code's ``x-claude-code-session-id`` header, else ``metadata.user_id``. Errors use Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``
with the matching HTTP status, also inside a stream (an ``error`` event).
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from redlite.server.anthropic_convert import to_chat_request
from redlite.server.anthropic_events import MessageStream, message_body
from redlite.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from redlite.server.chat_bridge import ChatRun, count_prompt_tokens
from redlite.server.errors import APIError
from redlite.server.wire_common import sse_event

log = logging.getLogger("redlite.server.anthropic")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error",
               501: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP ``status``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(error.status, error.message), status_code=error.status,
                        headers=error.headers)


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated as ``model``; a 400 APIError naming the first bad field."""
    try:
        data = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                       where or None) from None


def _session_key(request: Request, body: MessagesRequest) -> str | None:
    """Claude Code's ``x-claude-code-session-id`` header, else ``metadata.user_id``."""
    header = request.headers.get("x-claude-code-session-id")
    if header:
        return header
    user = (body.metadata or {}).get("user_id")
    return user if isinstance(user, str) and user else None


async def _stream(run: ChatRun, stream: MessageStream) -> AsyncIterator[bytes]:
    try:
        for event in stream.start():
            yield sse_event(event)
        try:
            async for piece in run:
                if piece is None:
                    yield sse_event(stream.ping())
                    continue
                for event in stream.feed(piece):
                    yield sse_event(event)
        except APIError as error:
            yield sse_event(anthropic_error_body(error.status, error.message))
            return
        for event in stream.finish(run.output, run.usage):
            yield sse_event(event)
    finally:
        run.close()


def mount_anthropic_routes(app: FastAPI, state) -> None:
    """Add the Messages routes to ``app`` (``state``: the server's ServerState)."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        try:
            body = await parse_body(request, MessagesRequest)
            chat = to_chat_request(body, _session_key(request, body))
            run = ChatRun(state, request, chat, tick_s=state.ping_interval_s)
            await run.start()
        except APIError as error:
            return anthropic_error_response(error)
        if body.stream:
            stream = MessageStream(chat.request_id, state.model_id, run.prompt_tokens)
            return StreamingResponse(_stream(run, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in run:
                pass
        except APIError as error:
            return anthropic_error_response(error)
        finally:
            run.close()
        return message_body(chat.request_id, state.model_id, run.output, run.usage)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        try:
            body = await parse_body(request, CountTokensRequest)
            tokens = await count_prompt_tokens(state, to_chat_request(body))
        except APIError as error:
            return anthropic_error_response(error)
        return {"input_tokens": tokens}
