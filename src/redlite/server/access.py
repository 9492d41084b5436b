"""The outermost middleware: request id, access log, and a JSON 500 for any unhandled error.

Every request gets an id ``req_<24 hex>`` (header ``x-request-id`` on every response, and in
every error body). When the request ends, one line goes to the ``redlite.access`` logger::

    POST /v1/chat/completions 200 12.3 ms id=req_... prompt=41 reused=30 generated=7

(duration in milliseconds from the first byte of the request to the end of the response; the
token fields only when a generation ran). An exception that escapes the application is logged
with its traceback and answered with 500 ``internal server error`` in the surface's error shape
(when the response has not started yet; else the connection is closed by the server).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from redlite.server.errors import send_error, surface_of

log = logging.getLogger("redlite.server")
access_log = logging.getLogger("redlite.access")

SCOPE_KEY = "redlite.context"


@dataclass
class RequestContext:
    """Per-request facts shared by the middlewares and the routes (``scope[SCOPE_KEY]``).

    tokens: (prompt, reused, generated) token counts once a generation ended, else None."""

    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex[:24]}")
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None
    tokens: tuple[int, int, int] | None = None

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
    if getattr(result, "index", 0) and context.tokens is not None:  # a later choice of n
        prompt, reused, generated = context.tokens
        context.tokens = (prompt, reused, generated + result.completion_tokens)
        return
    context.tokens = (result.prompt_tokens, result.cached_tokens, result.completion_tokens)


class AccessMiddleware:
    """Pure ASGI middleware: see the module docstring."""

    def __init__(self, app) -> None:
        self.app = app

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
            self._log(scope, context)

    @staticmethod
    def _log(scope, context: RequestContext) -> None:
        ms = (time.perf_counter() - context.started) * 1000.0
        line = (f"{scope['method']} {scope['path']} {context.status or '-'} {ms:.1f} ms "
                f"id={context.request_id}")
        if context.tokens is not None:
            prompt, reused, generated = context.tokens
            line += f" prompt={prompt} reused={reused} generated={generated}"
        access_log.info(line)


__all__ = ["AccessMiddleware", "RequestContext", "context_of", "request_id_of", "surface_of"]
