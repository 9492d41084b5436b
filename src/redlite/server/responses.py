"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` (:mod:`redlite.server.responses_items`), ``POST
/v1/responses/input_tokens`` (the prompt's tokens of a body, generating nothing; a prompt past
the context is counted, not refused).

An adapter (issue 14): the body (plus the stored conversation of ``previous_response_id``) is
converted into a :class:`~redlite.core.chat.ChatRequest` (:mod:`redlite.server.responses_convert`),
run by the chat service like a chat completion, and rendered as a response object or the
Responses event stream (:mod:`redlite.server.responses_events`). With ``store`` (default true)
the response and its conversation are kept in a bounded in-memory store
(:mod:`redlite.server.responses_store`); an unknown ``previous_response_id`` is a 404
``previous_response_not_found``. Errors use the OpenAI error shape; a failure after the stream
started is a ``response.failed`` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse

from redlite.core.chat import ChatOutput, ChatRequest
from redlite.server.access import context_of
from redlite.server.anthropic import parse_body
from redlite.server.chat_bridge import ChatRun, count_prompt_tokens
from redlite.server.errors import APIError
from redlite.server.responses_convert import responses_param, to_chat_request
from redlite.server.responses_events import ResponseStream, final_status, output_items, response_object
from redlite.server.responses_items import input_items, page
from redlite.server.responses_schemas import (AllowedToolsChoice, FunctionChoice, Includable,
                                              ResponsesRequest)
from redlite.server.responses_store import ResponseStore
from redlite.server.wire_common import sse_event
from redlite.server.session_key import body_session_value, session_key_of

log = logging.getLogger("redlite.server.responses")


def assistant_message(output: ChatOutput) -> dict:
    """The answer as an OpenAI-shaped assistant message (for the stored conversation)."""
    message: dict = {"role": "assistant", "content": output.content or (None if output.tool_calls else "")}
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in output.tool_calls]
    return message


def _meta(body: ResponsesRequest, chat: ChatRequest, model: str) -> dict:
    return {"id": chat.request_id, "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": chat.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": (body.reasoning.model_dump() if body.reasoning else
                          {"effort": None, "summary": None}),
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": (body.text.format if body.text and body.text.format
                                else {"type": "text"})},
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, (FunctionChoice, AllowedToolsChoice))
                            else body.tool_choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": "disabled", "metadata": body.metadata or {}}


def mount_responses_routes(app: FastAPI, state, store: ResponseStore | None = None) -> None:
    """Add the Responses routes to ``app``; ``store`` defaults to a fresh bounded store
    (kept as ``app.state.responses``)."""
    store = store if store is not None else ResponseStore()
    app.state.responses = store

    def keep(body: ResponsesRequest, chat: ChatRequest, output: ChatOutput, response: dict) -> None:
        if not body.store or response["status"] == "failed":
            return
        messages = chat.messages[1:] if body.instructions else list(chat.messages)
        store.put(response["id"], messages + [assistant_message(output)], response,
                  input_items(body.input))

    async def stream(run: ChatRun, events: ResponseStream, body: ResponsesRequest,
                     chat: ChatRequest, request_id: str) -> AsyncIterator[bytes]:
        try:
            for event in events.start():
                yield sse_event(event)
            try:
                async for piece in run:
                    if piece is not None:
                        for event in events.feed(piece):
                            yield sse_event(event)
            except APIError as error:
                for event in events.fail(error.code or "server_error", error.message, request_id):
                    yield sse_event(event)
                return
            finished, response = events.finish(run.output, run.usage)
            keep(body, chat, run.output, response)
            for event in finished:
                yield sse_event(event)
        finally:
            run.close()

    def previous_history(body: ResponsesRequest) -> list[dict] | None:
        if not body.previous_response_id:
            return None
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise APIError(404, f"previous response {body.previous_response_id!r} not found "
                           "(unknown, not stored, or evicted)", "previous_response_id",
                           "previous_response_not_found")
        return stored.messages

    @app.post("/v1/responses")
    async def create(request: Request) -> Any:
        body = await parse_body(request, ResponsesRequest)
        history = previous_history(body)
        chat = await asyncio.to_thread(to_chat_request, body, history)
        chat.session_key = session_key_of(
            request.headers, body_session_value("openai", {"prompt_cache_key": body.prompt_cache_key}))
        context = context_of(request.scope)
        chat.request_id = f"resp_{context.hex}"
        encrypted = "reasoning.encrypted_content" in (body.include or [])
        meta = _meta(body, chat, state.model_id)
        run = ChatRun(state, request, chat)
        try:
            await run.start()
        except APIError as error:
            error.param = responses_param(error.param)
            raise
        if body.stream:
            return StreamingResponse(stream(run, ResponseStream(meta, encrypted), body, chat,
                                                    context.request_id),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await run.finish()
        response = response_object(meta, final_status(run.output),
                                   output_items(run.output, encrypted), run.usage)
        keep(body, chat, run.output, response)
        return response

    # after POST /v1/responses: the OpenAPI document lists the full body there first
    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request) -> Any:
        body = await parse_body(request, ResponsesRequest)
        chat = await asyncio.to_thread(to_chat_request, body, previous_history(body))
        try:
            counted = await count_prompt_tokens(state, chat)
        except APIError as error:
            error.param = responses_param(error.param)
            raise
        return {"object": "response.input_tokens", "input_tokens": counted}

    def not_found(response_id: str) -> APIError:
        return APIError(404, f"response {response_id!r} not found", "response_id", "not_found")

    def stored(response_id: str):
        entry = store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return entry

    @app.get("/v1/responses/{response_id}/input_items", operation_id="list_input_items",
             summary="The input items of a stored response")
    async def list_input_items(response_id: str, after: str | None = None,
                               before: str | None = None, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc",
                               include: list[Includable] | None = Query(None)) -> Any:
        # include names output data (image urls, logprobs ...) that text-only items never carry
        return page(stored(response_id).input_items, after, before, limit, order)

    # one route for both methods, so a 405 names both in its Allow header; documented by
    # redlite.server.wire_openapi.wire_paths (FastAPI would give both methods one operationId)
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], include_in_schema=False)
    async def stored_response(request: Request, response_id: str) -> Any:
        if request.method == "GET":
            return stored(response_id).response
        if not store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
