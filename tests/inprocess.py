"""An in-process server (the ASGI app on an engine worker thread) for protocol tests, reached
through httpx's ASGI transport: no subprocess, no port."""

from __future__ import annotations

import contextlib
import json

import httpx

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import Generator
from redlite.core.generation_request import GeneratorSettings
from redlite.core.worker import EngineWorker
from redlite.engine.echo import EchoEngine
from redlite.server.app import ServerState, create_app
from redlite.server.chat_service import ChatOptions


@contextlib.contextmanager
def inprocess_app(engine=None, tokenizer=None, model_id="echo", chat_options=None):
    """Yield ``(app, state)`` for an engine (default: a rewindable echo engine)."""
    engine = engine or EchoEngine()
    tokenizer = tokenizer or ByteTokenizer()
    # one prefill call per request whatever its length, so tests can count requests' prefills
    worker = EngineWorker(Generator(engine, tokenizer, GeneratorSettings(prefill_chunk=1 << 30)))
    state = ServerState(worker, tokenizer, model_id, engine.max_context,
                        chat_options=chat_options or ChatOptions())
    try:
        yield create_app(state), state
    finally:
        worker.shutdown()


def async_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://redlite",
                             timeout=60)


def echo_call(name: str, arguments: dict) -> str:
    """The text of a hermes call exactly as the byte template renders it back (so an echo
    answer of this text is a call whose re-rendered history gives back the same bytes)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
