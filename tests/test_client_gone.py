"""A non-streamed chat request whose client leaves mid-answer ends as 499 (client closed the
request), not as the 503 of a shutdown: client time-outs must not look like overload in the
access log and metrics."""

from __future__ import annotations

import asyncio
import json

import pytest

from echo_app import echo_state
from redlite.engine.echo import EchoEngine
from redlite.server.app import create_app

pytestmark = pytest.mark.timeout(60)


def test_a_client_leaving_a_non_streamed_answer_is_499():
    state = echo_state(engine=EchoEngine(delay_ms=20.0))
    app = create_app(state)
    body = json.dumps({"messages": [{"role": "user", "content": "tell me a long story"}],
                       "max_tokens": 400}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent: list[dict] = []

    async def main():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(0.3)  # the client gives up mid-answer
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 30)

    try:
        asyncio.run(main())
    finally:
        state.worker.shutdown(wait_s=2.0)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 499
