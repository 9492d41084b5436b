"""Error answers of every API surface, rendered by one function.

The shape depends on the surface the request came in through, chosen by path prefix
(:func:`surface_of`):

* ``openai`` (the default): ``{"error": {"message", "type", "param", "code", "request_id"}}``
  as in the OpenAI API reference;
* ``anthropic`` (``/v1/messages...``): ``{"type": "error", "error": {"type", "message"},
  "request_id"}`` as in Anthropic's Messages API ("Errors" page), with ``error.details`` when
  the error has details (what the client SDK reads to adapt, e.g. ``error_code``).

Every error carries the request id (also sent as the ``x-request-id`` header) so a client can
quote it and the operator find the log lines: messages are short and never carry paths or
internal exception text; the details go to the log only.
"""

from __future__ import annotations

import json
from typing import Callable

from fastapi.responses import JSONResponse

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 403: "invalid_request_error", 404: "not_found_error",
                 405: "invalid_request_error", 408: "timeout_error",
                 413: "invalid_request_error", 415: "invalid_request_error",
                 500: "server_error", 501: "not_implemented_error", 503: "server_error"}

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
                    429: "rate_limit_error", 500: "api_error", 501: "api_error",
                    503: "overloaded_error"}


def _openai_body(status: int, message: str, param: str | None, code: str | None,
                 request_id: str | None, details: dict | None = None) -> dict:
    error = {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
             "param": param, "code": code}
    if request_id is not None:
        error["request_id"] = request_id
    return {"error": error}


def _anthropic_body(status: int, message: str, param: str | None, code: str | None,
                    request_id: str | None, details: dict | None = None) -> dict:
    body: dict = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                             "message": message}}
    if details is not None:
        body["error"]["details"] = details
    if request_id is not None:
        body["request_id"] = request_id
    return body


Renderer = Callable[[int, str, "str | None", "str | None", "str | None", "dict | None"], dict]

SURFACES: dict[str, Renderer] = {"openai": _openai_body, "anthropic": _anthropic_body}
"""surface name -> body renderer ``(status, message, param, code, request_id, details) -> dict``."""

SURFACE_PREFIXES: list[tuple[str, str]] = [("/v1/messages", "anthropic")]
"""(path prefix, surface) pairs, first match wins; other paths are ``openai``."""


def surface_of(path: str) -> str:
    """The API surface of a request path (see :data:`SURFACE_PREFIXES`)."""
    for prefix, surface in SURFACE_PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return surface
    return "openai"


class APIError(Exception):
    """An error the HTTP layer answers with ``status`` in the request's surface shape.

    message: short, meant for the client (no paths, no exception text); param: the offending
    request field (dotted path) or None; code: a machine-readable code or None; headers: extra
    response headers (``Retry-After``, ``Allow``...); details: the Anthropic body's
    ``error.details`` (the OpenAI shape has no such field)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 details: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers, self.details = headers, details

    def body(self, surface: str = "openai", request_id: str | None = None) -> dict:
        return error_body(self.status, self.message, self.param, self.code,
                          surface=surface, request_id=request_id, details=self.details)

    def response(self, surface: str = "openai", request_id: str | None = None) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers,
                              surface=surface, request_id=request_id, details=self.details)


def prompt_too_long(tokens: int, context: int, param: str, at_least: bool = False) -> APIError:
    """The 400 (code ``context_length_exceeded``, naming ``param``) for a prompt of ``tokens``
    tokens (a lower bound when ``at_least``, said after the counts) over a context of ``context``
    tokens. The message starts with Anthropic's wording, ``prompt is too long: N tokens > M
    maximum``, which Claude Code's compact-and-retry and other agents match (parsing the
    counts), and goes on with
    OpenAI's "maximum context length" phrase, on every surface."""
    bound = f" (at least {tokens}: counted before tokenizing)" if at_least else ""
    return APIError(400, f"prompt is too long: {tokens} tokens > {context} maximum{bound}; this "
                    f"model's maximum context length is {context} tokens", param,
                    "context_length_exceeded")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               *, surface: str = "openai", request_id: str | None = None,
               details: dict | None = None) -> dict:
    """The error object of ``surface`` for ``status`` (HTTP status code)."""
    return SURFACES[surface](status, message, param, code, request_id, details)


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None, *,
                   surface: str = "openai", request_id: str | None = None,
                   details: dict | None = None) -> JSONResponse:
    """A JSONResponse with ``status``, the surface's error object and ``x-request-id``."""
    headers = dict(headers or {})
    if request_id is not None:
        headers["x-request-id"] = request_id
    return JSONResponse(error_body(status, message, param, code, surface=surface,
                                   request_id=request_id, details=details),
                        status_code=status, headers=headers)


async def send_error(send, scope, status: int, message: str, param: str | None = None,
                     code: str | None = None, headers: dict[str, str] | None = None) -> None:
    """Answer an ASGI request from a middleware (before the app saw it) with an error in the
    request's surface shape; the request id is taken from the scope (see
    :mod:`redlite.server.access`)."""
    from redlite.server.access import request_id_of

    request_id = request_id_of(scope)
    body = json.dumps(error_body(status, message, param, code, surface=surface_of(scope["path"]),
                                 request_id=request_id)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def as_api_error(error: BaseException) -> APIError:
    """The APIError a failed job is answered with (500 ``generation failed`` for an engine
    exception: its text goes to the log, see :func:`redlite.server.access` ``log_failure``)."""
    from redlite.core.worker import ShuttingDown

    if isinstance(error, APIError):
        return error
    if isinstance(error, ShuttingDown):
        return APIError(503, str(error) or "server is shutting down", None, "shutting_down")
    if isinstance(error, ConnectionAbortedError):
        return APIError(499, "client closed the request")
    return APIError(500, "generation failed", None, "engine_error")
