"""Request body limits: size (413) and read time-out (408), as a pure ASGI middleware.

The whole body is read here, bounded by ``max_bytes`` (``--max-body-mib``) and by ``timeout_s``
seconds between chunks, then replayed to the application. A slow client only ties up its own
connection's task: uvicorn serves each connection asynchronously.
"""

from __future__ import annotations

import asyncio
import json

from redlite.server.errors import error_body


class BodyLimitMiddleware:
    """Reads each request body up front: 413 above ``max_bytes`` (by Content-Length or by the
    bytes received), 408 when ``timeout_s`` seconds pass between chunks."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send, 413, self._too_large())
            return
        chunks, total = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                await self._reject(send, 408, "timed out reading the request body")
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(send, 413, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"

    @staticmethod
    async def _reject(send, status: int, message: str) -> None:
        body = json.dumps(error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
