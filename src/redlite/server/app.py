"""The OpenAI-compatible HTTP API on FastAPI.

The HTTP side only reads, parses, tokenizes and relays: generations run on the engine worker
thread (:mod:`redlite.core.worker`), so ``/health`` and ``/v1/models`` answer at once even while
a generation runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from redlite.core.constraints import ConstraintError, build_constraint
from redlite.core.generation import GenerationRequest, GenerationResult
from redlite.core.grammar import check_constraint
from redlite.core.stop import normalize_stop
from redlite.core.tokenizer import Tokenizer
from redlite.core.worker import EngineWorker, Event, Job, QueueFull, ShuttingDown
from redlite.engine.base import SamplingParams
from redlite.server import completions as completions_route
from redlite.server import sampling_fields
from redlite.server.errors import APIError, as_api_error, error_body, error_response
from redlite.server.limits import BodyLimitMiddleware
from redlite.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from redlite.server.slots import mount_slot_routes
from redlite.server.sse import completion_body, stream_events

log = logging.getLogger("redlite.server")


@dataclass
class ServerState:
    """What the HTTP layer needs: the worker, the tokenizer and the served model's id."""

    worker: EngineWorker
    tokenizer: Tokenizer
    model_id: str
    max_context: int
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    retry_after_s: int = 1
    slots: Any = None  # redlite.server.slots.SlotService; None: the slot API answers 501


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic names union members (e.g. 'str', 'list[TextPart]') in loc: drop them
    parts = [p for p in parts if not (p[:1].islower() and ("[" in p or p in ("str", "int")))]
    return ".".join(parts) or None


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
    ``/health`` (and the slot API when enabled), with OpenAI-shaped errors for every failure."""
    app = FastAPI(title="redlite", docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_body_bytes,
                       timeout_s=state.body_timeout_s)
    tokenizer_lock = threading.Lock()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return error_response(exc.status_code, message)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "queue_depth": state.worker.queue_depth, "busy": state.worker.busy}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": state.model_id, "object": "model", "created": 0, "owned_by": "redlite",
             "max_model_len": state.max_context}]}

    def sampling_of(body: SamplingFields, chat: bool) -> SamplingParams:
        return sampling_fields.sampling_of(body, state.tokenizer.vocab_size, chat)

    def stops_of(body: SamplingFields) -> list[str]:
        try:
            return normalize_stop(body.stop)
        except ValueError as error:
            raise APIError(400, str(error), "stop") from None

    def check_length(ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        if len(ids) > state.max_context:
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than the context of "
                           f"{state.max_context} tokens", param, "context_length_exceeded")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await _parse(request, ChatCompletionRequest)
        stop = stops_of(body)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]

        def render():
            with tokenizer_lock:
                return state.tokenizer.render_chat(messages)
        try:
            rendered = await asyncio.to_thread(render)
        except Exception as error:  # a template that rejects the conversation
            raise APIError(400, f"cannot render the conversation: {error}", "messages") from None
        check_length(rendered.token_ids, "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        sampling = sampling_of(body, chat=True)
        if sampling.logprobs is not None or body.n > 1:
            raise APIError(400, "logprobs and n > 1 are not supported for chat completions yet",
                           "logprobs" if sampling.logprobs is not None else "n")
        constraint = await asyncio.to_thread(constraint_of, body.response_format)
        sampling = dataclasses.replace(sampling, constraint=constraint)
        generation = GenerationRequest(rendered.token_ids, max_tokens, sampling, stop,
                                       rendered.message_ends, f"chatcmpl-{uuid.uuid4().hex[:24]}")
        return await _serve(request, body, generation, chat=True)

    def constraint_of(response_format: dict | None):
        try:
            spec = build_constraint(response_format)
            if spec is not None:
                check_constraint(spec, state.tokenizer)
        except ConstraintError as error:
            raise APIError(400, str(error), error.param) from None
        return spec

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _parse(request, CompletionRequest)
        stop = stops_of(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            def encode():
                with tokenizer_lock:
                    return state.tokenizer.encode(prompt)
            ids = await asyncio.to_thread(encode)
        else:
            ids = list(prompt)
            if any(t < 0 or t >= state.tokenizer.vocab_size for t in ids):
                raise APIError(400, f"token ids must be in [0, {state.tokenizer.vocab_size})", "prompt")
        check_length(ids, "prompt")
        generation = GenerationRequest(ids, body.max_tokens, sampling_of(body, chat=False), stop, [],
                                       f"cmpl-{uuid.uuid4().hex[:24]}", n=body.n)
        return await completions_route.serve(state, request, body, generation)

    async def _serve(request: Request, body: SamplingFields, generation: GenerationRequest,
                     chat: bool) -> Any:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = Job(generation, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            state.worker.submit(job)
        except QueueFull:
            raise APIError(503, "server busy", None, "server_busy",
                           {"Retry-After": str(state.retry_after_s)}) from None
        except ShuttingDown:
            raise APIError(503, "server is shutting down", None, "shutting_down") from None
        first = await _first_event(request, job, events)
        if first is None:
            return JSONResponse(error_body(499, "client closed the request"), status_code=499)
        if first.kind == "error":
            raise as_api_error(first.value)
        meta = {"id": generation.request_id, "created": int(time.time()), "model": state.model_id,
                "chat": chat, "prompt_tokens": len(generation.prompt_ids)}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_events(events, job, meta, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(request, job, events, meta)

    mount_slot_routes(app, state)
    return app


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """Parse the JSON body (whatever its content type, as llama.cpp does) into ``model``;
    raise a 400 APIError naming the offending field."""
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
        param = _param_of(tuple(first.get("loc", ())))
        raise APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")),
                       param) from None


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel ``job`` when the client closes its connection (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _first_event(request: Request, job: Job, events: asyncio.Queue) -> Event | None:
    """Wait until the job starts (or fails); None when the client left while it waited."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, job))
    getter = asyncio.ensure_future(events.get())
    try:
        await asyncio.wait({watcher, getter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


async def _collect(request: Request, job: Job, events: asyncio.Queue, meta: dict) -> Any:
    watcher = asyncio.ensure_future(_watch_disconnect(request, job))
    pieces: list[str] = []
    try:
        while True:
            event = await events.get()
            if event.kind == "text":
                pieces.append(event.value)
            elif event.kind == "done":
                if event.value.finish_reason == "cancelled":
                    # the client is still here, so the server is stopping: the answer is cut
                    raise APIError(503, "server is shutting down; the answer was cut off",
                                   None, "shutting_down")
                return completion_body(meta, "".join(pieces), event.value)
            elif event.kind == "error":
                raise as_api_error(event.value)
    finally:
        watcher.cancel()


__all__ = ["ServerState", "create_app", "GenerationResult"]
