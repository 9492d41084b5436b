"""One replica: a whole redlite server (engine, parking tiers, the ASGI app of ``redlite
serve``) inside a Ray Serve replica, driven by the ingress through :meth:`Replica.handle`.

The request arrives as plain data (:class:`ForwardedRequest`); the app's response comes back as
a stream: first a ``(status, headers)`` tuple, then the body chunks as the app sends them (SSE
events unchanged). Every response carries ``x-redlite-replica`` (the Ray Serve replica id). A
cancelled stream (client gone) reaches the app as ``http.disconnect``. On removal (scale-down,
``serve.delete``, shutdown) the engine stops and the conversations are saved to the shared
``--session-dir`` (``__del__``, Ray Serve's graceful shutdown hook).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

log = logging.getLogger("redlite.cluster")

REPLICA_HEADER = "x-redlite-replica"


@dataclass
class ForwardedRequest:
    """An HTTP request as the ingress read it: method, path, raw query string, headers as
    (lower-case name, value) pairs, the whole body, and the client's (host, port)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[str, str]]
    body: bytes
    client: tuple[str, int] | None = None


def _scope(request: ForwardedRequest) -> dict:
    """The ASGI HTTP scope of a forwarded request."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": request.method, "scheme": "http",
            "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": request.query, "client": request.client,
            "server": ("127.0.0.1", 0),
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]}


async def call_asgi(app, request: ForwardedRequest, extra_headers: list[tuple[str, str]] = ()
                    ) -> AsyncIterator[object]:
    """Run ``app`` on ``request``; yields ``(status, [(name, value), ...])`` then the body
    chunks (bytes). Closing the iterator early tells the app the client disconnected."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1"))
                           for k, v in message.get("headers", [])]
                yield message["status"], headers + list(extra_headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            try:  # the app stops at its next chunk or token; wait_for cancels it after 30 s
                await asyncio.wait_for(task, timeout=30.0)
            except Exception:  # the app logged its own failure; the stream is over
                pass


class Replica:
    """A redlite server in a Ray Serve replica (wrapped by ``serve.deployment`` in
    :func:`redlite.cluster.app.build_app`). ``args``: the ``redlite serve`` options."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ray import serve

        from redlite.server.run import build_server

        logging.basicConfig(level=args.log_level.upper())
        self.id = serve.get_replica_context().replica_id.unique_id
        self.server = build_server(args)
        log.info("replica %s serving %s", self.id, self.server.model_id)

    async def handle(self, request: ForwardedRequest, affinity_key: str | None = None
                     ) -> AsyncIterator[object]:
        """Serve one request (a streaming method: see the module docstring). affinity_key is
        read by the router only."""
        async for item in call_asgi(self.server.app, request, [(REPLICA_HEADER, self.id)]):
            yield item

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the engine worker thread has ended."""
        if not self.server.worker.alive:
            raise RuntimeError(f"replica {self.id}: the engine worker has stopped")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is None:
            return
        worker, parking = server.worker, server.parking
        worker.shutdown(wait_s=0.0)
        idle = worker.join(10.0)
        if parking.sessions is not None:
            saved = parking.save_all(worker.generator, live=idle)
            parking.sessions.close()  # its owner lock: the others may adopt its files now
            log.info("replica %s stopped: %d conversations on the shared tier", self.id, saved)
