"""The OpenAI-compatible HTTP API on FastAPI.

The HTTP side only reads, parses, tokenizes and relays: generations run on the engine worker
thread (:mod:`redlite.core.worker`), so ``/health`` and ``/v1/models`` answer at once even while
a generation runs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.core.stop import normalize_stop
from redlite.core.tokenizer import Tokenizer, min_prompt_tokens
from redlite.core.worker import EngineWorker
from redlite.engine.base import SamplingParams
from redlite.server import completions as completions_route
from redlite.server import sampling_fields
from redlite.server.access import AccessMiddleware, context_of
from redlite.server.chat_service import ChatService
from redlite.server.errors import APIError, prompt_too_long, surface_of
from redlite.server.validation_errors import first_error, loads_or_none, param_of
from redlite.server.jobs import RETRY_AFTER_S, in_thread
from redlite.server.limits import BodyLimitMiddleware
from redlite.server.metrics import ServerMetrics
from redlite.server.observe_routes import mount_observe_routes
from redlite.server.openai_chat import chat_request_of, stream_chunks
from redlite.server.session_key import body_session_value, session_key_of
from redlite.server.openai_chat import completion_body as chat_completion_body
from redlite.server.anthropic import mount_anthropic_routes
from redlite.server.responses import mount_responses_routes
from redlite.server.openapi import install_openapi
from redlite.server.schemas import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                                    unsupported_field)
from redlite.server.security import SecurityMiddleware, SecurityOptions, require_json
from redlite.server.slots import mount_slot_routes
from redlite.server.tokenize_routes import mount_tokenize_routes

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
    retry_after_s: int = RETRY_AFTER_S  # of a 503 "server busy"
    slots: Any = None  # redlite.server.slots.SlotService; None: the slot API answers 501
    security: SecurityOptions = field(default_factory=SecurityOptions)
    chat_options: Any = None  # redlite.server.chat_service.ChatOptions (--tool-parser ...)
    chat: Any = None  # the ChatService every chat adapter calls (made by create_app when None)
    ping_interval_s: float = 5.0  # Anthropic streams: a ping after this long without output
    metrics: bool = True  # --metrics / --no-metrics: GET /metrics and the per-request counts


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
    ``/v1/models/{id}``, ``/health`` (and the slot API when enabled), with errors in the
    surface's shape for every failure (:mod:`redlite.server.errors`).

    Middlewares, outermost first: request id + access log + JSON 500
    (:mod:`redlite.server.access`), CORS (only with ``security.cors_origins``), Host / API key
    (:mod:`redlite.server.security`), body size and deadline (:mod:`redlite.server.limits`).
    Routes that take a body check its JSON content type after routing (415)."""
    app = FastAPI(title="redlite", docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.max_body_bytes,
                       timeout_s=state.body_timeout_s)
    app.add_middleware(SecurityMiddleware, options=state.security)
    if state.security.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=state.security.cors_origins,
                           allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["authorization", "content-type", "x-api-key"],
                           expose_headers=["x-request-id", "retry-after"])
    metrics = ServerMetrics(state) if state.metrics else None
    app.add_middleware(AccessMiddleware, on_end=(
        None if metrics is None else
        lambda scope, context: metrics.observe(scope, context.status, context.results)),
        stopping=lambda: getattr(state.worker, "closing", False))
    if state.chat is None:  # no tokenizer lock: rendering and tokenizing are thread-safe
        state.chat = ChatService(state.worker, state.tokenizer, state.max_context,
                                 state.chat_options, state.retry_after_s)

    def respond(request: Request, error: APIError) -> JSONResponse:
        return error.response(surface_of(request.url.path), context_of(request.scope).request_id)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return respond(request, APIError(exc.status_code, message, None, None,
                                         dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = param_of(tuple(first.get("loc", ()))[1:])
        return respond(request, APIError(400, f"{param}: {first.get('msg')}", param))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "queue_depth": state.worker.queue_depth, "busy": state.worker.busy}

    app.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head")

    def model_object(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "redlite",
                "max_model_len": state.max_context}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object(state.model_id)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        # every model name is served by the one model (chat accepts any ``model``): answer
        # with the served model's object, as responses name the served model
        return model_object(state.model_id)

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
            raise prompt_too_long(len(ids), state.max_context, param)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        raw = await _json_body(request)
        headers, request_id = request.headers, f"chatcmpl-{context_of(request.scope).hex}"
        loop = asyncio.get_running_loop()

        def prepare():  # parse, build, render and queue off the event loop, in one thread hand-off
            body = _validate(raw, ChatCompletionRequest)
            chat_request = chat_request_of(body, sampling_of(body, chat=True), stops_of(body), request_id)
            chat_request.session_key = session_key_of(
                headers, body_session_value("openai", body.model_extra or {}))
            prepared = state.chat.prepare_sync(chat_request)
            return body, chat_request, state.chat.enqueue_sync(chat_request, prepared, loop, request)
        body, chat_request, queued = await in_thread(prepare, lambda done: done[2].job)
        stream = await state.chat.start(chat_request, request, queued)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_chunks(stream, state.model_id, include_usage,
                                                   context_of(request.scope).request_id),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            result = await stream.collect(request)
        finally:
            stream.cancel()
        return chat_completion_body(stream, state.model_id, result)

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
            at_least = min_prompt_tokens([prompt], getattr(state.tokenizer, "max_token_chars", None))
            if at_least > state.max_context:
                raise prompt_too_long(at_least, state.max_context, "prompt", at_least=True)
            ids = await asyncio.to_thread(state.tokenizer.encode, prompt)
        else:
            ids = list(prompt)
            if any(t < 0 or t >= state.tokenizer.vocab_size for t in ids):
                raise APIError(400, f"token ids must be in [0, {state.tokenizer.vocab_size})", "prompt")
        check_length(ids, "prompt")
        generation = GenerationRequest(ids, body.max_tokens, sampling_of(body, chat=False), stop, [],
                                       f"cmpl-{context_of(request.scope).hex}", n=body.n or 1)
        return await completions_route.serve(state, request, body, generation)

    mount_slot_routes(app, state)
    mount_anthropic_routes(app, state)
    mount_responses_routes(app, state)
    install_openapi(app, state)
    mount_tokenize_routes(app, state)
    mount_observe_routes(app, state, metrics)
    return app


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """Parse the JSON body into ``model`` (:func:`_validate`, in a worker thread: a body of
    thousands of messages must not stall the event loop)."""
    raw = await _json_body(request)
    return await asyncio.to_thread(_validate, raw, model)


async def _json_body(request: Request) -> bytes:
    """The body of a request declared JSON (415 otherwise)."""
    require_json(request.headers)
    return await request.body()


def _validate(raw: bytes, model: type[BaseModel]) -> Any:
    """``raw`` parsed into ``model`` (pydantic's JSON parser: strict types, nesting depth
    bounded, lone surrogates refused); raise a 400 APIError naming the offending field, or the
    first field set that the server does not implement (the model's ``unsupported_fields``:
    :func:`redlite.server.schemas.unsupported_field`)."""
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as error:
        first = first_error(error)
        if first["type"] == "json_invalid":
            reason = (first.get("ctx") or {}).get("error", "")
            raise APIError(400, f"request body is not valid JSON: {reason}".rstrip(": ")) from None
        loc = tuple(first.get("loc", ()))
        if not loc and first["type"] in ("model_type", "model_attributes_type", "dict_type"):
            raise APIError(400, "request body must be a JSON object") from None
        param = param_of(loc, loads_or_none(raw))
        raise APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")),
                       param) from None
    unsupported = unsupported_field(parsed)
    if unsupported is not None:
        name, entry = unsupported
        raise APIError(400, f"{entry.what} is not supported by this server", name,
                       "unsupported_field", details=entry.details)
    return parsed


__all__ = ["ServerState", "create_app", "GenerationResult"]
