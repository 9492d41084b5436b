"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          408: "timeout_error", 413: "invalid_request_error", 500: "server_error",
          501: "not_implemented_error", 503: "server_error"}


class APIError(Exception):
    """An error the HTTP layer answers with ``status`` and the OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object for ``status`` (HTTP status code)."""
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse with ``status`` and the OpenAI error object."""
    return APIError(status, message, param, code, headers).response()


def as_api_error(error: BaseException) -> APIError:
    """The APIError a failed job is answered with (500 for an engine exception)."""
    from redlite.core.worker import ShuttingDown

    if isinstance(error, APIError):
        return error
    if isinstance(error, ShuttingDown):
        return APIError(503, str(error) or "server is shutting down", None, "shutting_down")
    if isinstance(error, ConnectionAbortedError):
        return APIError(499, "client closed the request")
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", None, "engine_error")
