"""The ASGI app with the echo engine, in process, behind a TestClient (an httpx.Client that the
official SDKs accept as ``http_client``). Requests time out after ``timeout_s``."""

from __future__ import annotations

import signal

from fastapi.testclient import TestClient

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import Generator
from redlite.core.worker import EngineWorker
from redlite.engine.echo import EchoEngine
from redlite.server.app import ServerState, create_app


def _timed_out(*_) -> None:
    raise TimeoutError("in-process test ran past its timeout")


class EchoApp:
    """``client``: the TestClient; ``engine``: the EchoEngine (counters); ``app``: the app.
    While it is open, SIGALRM fails the test after ``timeout_s`` seconds (the TestClient
    transport ignores request timeouts)."""

    def __init__(self, timeout_s: float = 30.0, ping_interval_s: float = 5.0, **engine_args) -> None:
        signal.signal(signal.SIGALRM, _timed_out)
        signal.alarm(int(timeout_s))
        self.engine = EchoEngine(**engine_args)
        self.worker = EngineWorker(Generator(self.engine, ByteTokenizer()))
        self.app = create_app(ServerState(self.worker, ByteTokenizer(), "echo", self.engine.max_context,
                                          ping_interval_s=ping_interval_s))
        self.client = TestClient(self.app, base_url="http://127.0.0.1")
        self.url = "http://127.0.0.1"

    def close(self) -> None:
        signal.alarm(0)
        self.client.close()
        self.worker.shutdown()

    def __enter__(self) -> "EchoApp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
