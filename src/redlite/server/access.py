"""The outermost middleware: request id, access log, and a JSON 500 for any unhandled error.

Every request gets an id ``req_<24 hex>`` (header ``x-request-id`` on every response, and in
every error body). When the request ends, one line goes to the ``redlite.access`` logger::

    POST /v1/chat/completions 200 12.3 ms id=req_... prompt=41 reused=30 generated=7

(duration in milliseconds from the first byte of the request to the end of the response; the
token fields only when a generation ran). A generation whose client left (a stream whose
connection closed, or one the server cut as it stops) stops at its next prefill chunk or token,
after the response has ended: the line waits for that, up to :data:`SETTLE_S` (while stopping
:data:`STOP_SETTLE_S`), so it carries the counts of what ran. An exception
that escapes the application is logged with its traceback and answered with 500 ``internal
server error`` in the surface's error shape (when the response has not started yet; else the
connection is closed by the server).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from redlite.server.errors import send_error, surface_of

log = logging.getLogger("redlite.server")
access_log = logging.getLogger("redlite.access")

SCOPE_KEY = "redlite.context"
SETTLE_S = 10.0  # the longest the log line waits for a cancelled generation to stop
STOP_SETTLE_S = 1.0  # the same while the server stops (a cut stream's line still has its counts)


@dataclass
class RequestContext:
    """Per-request facts shared by the middlewares and the routes (``scope[SCOPE_KEY]``).

    tokens: (prompt, reused, generated) token counts once a generation ended, else None.
    results: the generations' results (one per choice), for the metrics.
    session_key: the chat request's session identity (``ChatRequest.session_key``), if any.
    job: the engine :class:`~redlite.core.worker.Job` of the request's generation once it
    started (:func:`redlite.server.jobs.submit`), else None. ended: when the response ended
    (``time.perf_counter``), else None."""

    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex[:24]}")
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None
    tokens: tuple[int, int, int] | None = None
    results: list = field(default_factory=list)
    session_key: str | None = None
    job: Any = None
    ended: float | None = None

    @property
    def hex(self) -> str:
        """The random part of the id, to name what the request creates (``chatcmpl-<hex>``)."""
        return self.request_id.split("_", 1)[1]


def context_of(scope) -> RequestContext:
    """The request's context (a fresh one when the app runs without :class:`AccessMiddleware`)."""
    context = scope.get(SCOPE_KEY)
    if context is None:
        context = scope[SCOPE_KEY] = RequestContext()
    return context


def request_id_of(scope) -> str:
    return context_of(scope).request_id


def note_event(scope, event) -> None:
    """Record a finished generation's token counts for the access log line (``event``: a
    worker :class:`~redlite.core.worker.Event`; called on the worker thread, no-op when
    ``scope`` is None or the event is not ``done``). The later choices of an ``n`` > 1 request
    add their generated tokens."""
    if scope is None or event.kind != "done":
        return
    result = event.value
    context = context_of(scope)
    context.results.append(result)
    if getattr(result, "index", 0) and context.tokens is not None:  # a later choice of n
        prompt, reused, generated = context.tokens
        context.tokens = (prompt, reused, generated + result.completion_tokens)
        return
    context.tokens = (result.prompt_tokens, result.cached_tokens, result.completion_tokens)


class AccessMiddleware:
    """Pure ASGI middleware: see the module docstring. ``on_end(scope, context)`` (optional)
    runs after each HTTP request, after the log line (the metrics count it there).
    ``stopping()`` (optional): True once the server is shutting down (then the line waits for
    a cancelled generation's counts up to :data:`STOP_SETTLE_S`, not :data:`SETTLE_S`)."""

    def __init__(self, app, on_end=None, stopping=None) -> None:
        self.app = app
        self.on_end = on_end
        self.stopping = stopping or (lambda: False)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = scope[SCOPE_KEY] = RequestContext()
        header = (b"x-request-id", context.request_id.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                context.status = message["status"]
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append(header)
                message = dict(message, headers=headers)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("%s %s %s failed", context.request_id, scope["method"], scope["path"])
            if context.status is None:
                await send_error(send_with_id, scope, 500, "internal server error", None,
                                 "internal_error")
            else:
                raise
        finally:
            context.ended = time.perf_counter()
            try:
                await _cancelled_generation_end(context, STOP_SETTLE_S if self.stopping() else SETTLE_S)
            finally:
                self._log(scope, context)
                if self.on_end is not None:
                    self.on_end(scope, context)

    @staticmethod
    def _log(scope, context: RequestContext) -> None:
        record = access_record(scope, context)
        line = (f"{record['method']} {record['path']} {context.status or '-'} "
                f"{record['ms']:.1f} ms id={context.request_id}")
        if context.tokens is not None:
            prompt, reused, generated = context.tokens
            line += f" prompt={prompt} reused={reused} generated={generated}"
        access_log.info(line, extra={"access": record})


async def _cancelled_generation_end(context: RequestContext, settle_s: float) -> None:
    """Wait (up to ``settle_s`` seconds) for the request's generation to end when its client
    left or the server stops it and it still runs: its token counts are noted when it ends
    (:func:`note_event`)."""
    job = context.job
    if job is not None and job.request.cancelled.is_set() and not job.finished.is_set():
        try:
            await asyncio.to_thread(job.finished.wait, settle_s)
        except asyncio.CancelledError:  # a forced stop cancels the wait: log what is known
            pass


def access_record(scope, context: RequestContext) -> dict:
    """The access log's fields (``--log-format json`` writes them): request_id, method, path,
    status, ms (duration), session_key, and once a generation ran prompt / reused / prefilled /
    generated tokens, ttft_ms and miss_reason (None for a plain extension) of its first choice."""
    record = {"request_id": context.request_id, "method": scope["method"], "path": scope["path"],
              "status": context.status,
              "ms": round(((context.ended or time.perf_counter()) - context.started) * 1000.0, 3),
              "session_key": context.session_key}
    first = next((r for r in context.results if not getattr(r, "index", 0)), None)
    if context.tokens is not None:
        prompt, reused, generated = context.tokens
        prefilled = first.prefilled_tokens if first is not None else prompt - reused
        record.update(prompt=prompt, reused=reused, prefilled=prefilled, generated=generated)
    if first is not None:
        plan = getattr(first, "plan", None)
        reason = getattr(plan, "reason", None)
        record.update(ttft_ms=round(first.ttft_ms, 3),
                      miss_reason=None if reason is None else reason.value)
    return record


__all__ = ["AccessMiddleware", "RequestContext", "context_of", "request_id_of", "surface_of"]
