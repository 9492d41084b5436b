"""Request body limits: size (413) and a total read deadline (408), as a pure ASGI middleware.

The whole body is read here, bounded by ``max_bytes`` (``--max-body-mib``) and by ``timeout_s``
seconds (``--body-timeout-s``) for the WHOLE body, counted from the end of the headers: a
client trickling one byte a second cannot hold a connection (and its buffer) open past it. The
body is then replayed to the application. A slow client only ties up its own connection's task:
uvicorn serves each connection asynchronously.
"""

from __future__ import annotations

import asyncio

from redlite.server.errors import send_error


class BodyLimitMiddleware:
    """Reads each request body up front: 413 above ``max_bytes`` (by Content-Length or by the
    bytes received), 408 when the whole body has not arrived ``timeout_s`` seconds after the
    request started."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send, scope)
            return
        chunks, total = [], 0
        try:
            # one deadline for the whole body (no task per chunk, as wait_for would make)
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    total += len(chunk)
                    if total > self.max_bytes:
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await send_error(send, scope, 408, "timed out reading the request body", None,
                             None, {"Connection": "close"})
            return
        if total > self.max_bytes:
            await self._too_large(send, scope)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send, scope) -> None:
        await send_error(send, scope, 413, f"request body larger than {self.max_bytes} bytes",
                         None, None, {"Connection": "close"})
