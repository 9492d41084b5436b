"""The in-process echo app (:func:`inprocess.inprocess_app`) behind a TestClient, an
httpx.Client that the official sync SDKs accept as ``http_client``."""

from __future__ import annotations

import signal

from fastapi.testclient import TestClient

from inprocess import inprocess_app
from redlite.engine.echo import EchoEngine


def _timed_out(*_) -> None:
    raise TimeoutError("in-process test ran past its timeout")


class EchoApp:
    """``client``: the TestClient; ``engine``: the EchoEngine (counters); ``app``, ``state``.
    While it is open, SIGALRM fails the test after ``timeout_s`` seconds (the TestClient
    transport ignores request timeouts)."""

    def __init__(self, timeout_s: float = 30.0, ping_interval_s: float = 5.0, **engine_args) -> None:
        signal.signal(signal.SIGALRM, _timed_out)
        signal.alarm(int(timeout_s))
        self.engine = EchoEngine(**engine_args)
        self._context = inprocess_app(self.engine)
        self.app, self.state = self._context.__enter__()
        self.state.ping_interval_s = ping_interval_s
        self.client = TestClient(self.app, base_url="http://127.0.0.1")
        self.url = "http://127.0.0.1"

    def close(self) -> None:
        signal.alarm(0)
        self.client.close()
        self._context.__exit__(None, None, None)

    def __enter__(self) -> "EchoApp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
