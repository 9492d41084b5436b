"""A non-streamed chat request whose client leaves mid-answer ends as 499 (client closed the
request), not as the 503 of a shutdown: client time-outs must not look like overload in the
access log and metrics. A streamed one's access line carries the token counts of what ran."""

from __future__ import annotations

import asyncio
import json

import pytest

from echo_app import echo_state
from redlite.engine.echo import EchoEngine
from redlite.server.app import create_app

pytestmark = pytest.mark.timeout(60)


def chat_scope(body: bytes) -> dict:
    """The ASGI scope of a chat completion request with ``body``."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


def leave_after(app, body: bytes, seconds: float) -> list[dict]:
    """Run ``app`` on a chat request with ``body`` whose client disconnects ``seconds`` after
    sending it; returns the ASGI messages the app sent."""
    sent: list[dict] = []

    async def main():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(seconds)  # the client gives up mid-answer
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(app(chat_scope(body), receive, send), 30)

    asyncio.run(main())
    return sent


def test_a_client_leaving_a_non_streamed_answer_is_499():
    state = echo_state(engine=EchoEngine(delay_ms=20.0))
    app = create_app(state)
    body = json.dumps({"messages": [{"role": "user", "content": "tell me a long story"}],
                       "max_tokens": 400}).encode()
    try:
        sent = leave_after(app, body, 0.3)
    finally:
        state.worker.shutdown(wait_s=2.0)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 499


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_quick_retry_reuses_what_the_left_request_prefilled(parallel, caplog):
    """The client of a long prompt leaves during its prefill and sends it again at once (the
    official clients retry a timed-out request): the retry waits for the slot that keeps what
    was prefilled (``--parallel 4`` as ``--parallel 1``), not an empty one."""
    from inprocess import async_client

    state = echo_state(engine=EchoEngine(prefill_delay_ms=1.0), parallel=parallel, prefill_chunk=200)
    app = create_app(state)
    prompt = "a long prompt with many words in it " * 60
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}).encode()
    scope = chat_scope(body)

    async def main():
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        gone = asyncio.Event()

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(0.5)  # mid-prefill: 2,000+ tokens at 1 ms each
            gone.set()
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        first = asyncio.ensure_future(app(scope, receive, send))
        await gone.wait()
        async with async_client(app) as client:
            r = await client.post("/v1/chat/completions", json=json.loads(body))
        await asyncio.wait_for(first, 30)
        return r.json()["usage"]

    try:
        with caplog.at_level("INFO", logger="redlite.generation"):
            usage = asyncio.run(asyncio.wait_for(main(), 40))
    finally:
        state.worker.shutdown(wait_s=2.0)
    stopped = next(m for m in caplog.messages if "prefill stopped at" in m)
    kept = int(stopped.split("prefill stopped at ")[1].split()[0])
    assert kept >= 200 and usage["prompt_tokens_details"]["cached_tokens"] == kept


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_client_leaving_a_stream_logs_its_token_counts(parallel, caplog):
    """The stream's client leaves mid-answer: the access line waits for the generation to stop
    (its next token) and carries prompt, reused and generated tokens as a finished one does."""
    state = echo_state(engine=EchoEngine(delay_ms=20.0), parallel=parallel)
    app = create_app(state)
    body = json.dumps({"messages": [{"role": "user", "content": "tell me a long story " * 20}],
                       "max_tokens": 400, "stream": True}).encode()
    try:
        with caplog.at_level("INFO", logger="redlite"):
            sent = leave_after(app, body, 0.3)
    finally:
        state.worker.shutdown(wait_s=2.0)
    assert next(m for m in sent if m["type"] == "http.response.start")["status"] == 200
    access = next(r for r in caplog.records if r.name == "redlite.access")
    assert "generated=" in access.getMessage(), access.getMessage()
    done = next(m for m in caplog.messages if "finish cancelled" in m)
    generated = int(done.split("generated ")[1].split()[0])
    prompt = len(state.tokenizer.render_chat(json.loads(body)["messages"]).token_ids)
    assert f"prompt={prompt} reused=0 generated={generated}" in access.getMessage()
    assert 3 < generated < 400
    assert access.access["generated"] == generated and access.access["ms"] < 2000


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_prefill_left_midway_counts_what_was_read(parallel, caplog):
    """The client leaves during the prefill: the access line, ``/metrics`` and
    ``/dashboard/data`` count the prompt tokens that were read (not the whole prompt's rest), and
    a request that never reached its first token adds no time-to-first-token observation."""
    from inprocess import async_client
    from test_metrics import value
    from prometheus_client.parser import text_string_to_metric_families

    state = echo_state(engine=EchoEngine(prefill_delay_ms=1.0), parallel=parallel, prefill_chunk=200)
    app = create_app(state)
    body = json.dumps({"messages": [{"role": "user", "content": "many words in a prompt " * 100}],
                       "max_tokens": 4}).encode()

    async def observe():
        async with async_client(app) as client:
            metrics = (await client.get("/metrics")).text
            return metrics, (await client.get("/dashboard/data")).json()

    try:
        with caplog.at_level("INFO", logger="redlite"):
            leave_after(app, body, 0.5)
            metrics, data = asyncio.run(observe())
    finally:
        state.worker.shutdown(wait_s=2.0)
    stopped = next(m for m in caplog.messages if "prefill stopped at" in m)
    kept, prompt = (int(stopped.split("prefill stopped at ")[1].split()[i]) for i in (0, 2))
    assert 0 < kept < prompt
    access = next(r for r in caplog.records if r.name == "redlite.access")
    assert access.access["status"] == 499 and access.access["prefilled"] == kept
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert value(m, "redlite_tokens_total", kind="prompt") == prompt
    assert value(m, "redlite_tokens_total", kind="prefilled") == kept
    assert value(m, "redlite_time_to_first_token_seconds_count") == 0
    assert data["recent"][0]["prefilled"] == kept
