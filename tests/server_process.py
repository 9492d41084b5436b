"""Start a real ``redlite serve`` process on a free loopback port for protocol tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process; ``url`` is its base URL, ``log()`` what it printed so far.
    ``running`` holds the servers not yet stopped (conftest.py reports their exit status and
    log when a test fails)."""

    running: list["ServerProcess"] = []

    def __init__(self, *args: str, engine: str = "echo", timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="redlite-test-", suffix=".log",
                                                delete=False)
        self._final_log = ""
        command = [sys.executable, "-m", "redlite.cli", "serve", "--engine", engine,
                   "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")  # a crash logs its stacks
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        ServerProcess.running.append(self)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        """What the server printed so far ("" once :meth:`stop` deleted the log)."""
        try:
            with open(self._log.name, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return self._final_log

    def wait_for_log(self, text: str, timeout_s: float = 5.0) -> str:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in log:\n{self.log()}")
            time.sleep(0.02)
        return self.log()

    def signal(self, sig: int = signal.SIGINT) -> None:
        self.proc.send_signal(sig)

    def report(self, tail_chars: int = 8000) -> str:
        """The exit status so far (None: running; negative: killed by that signal) and the
        log's last ``tail_chars`` characters, for a failed test's report."""
        status = self.proc.poll()
        state = "running" if status is None else f"exited with status {status}"
        return f"server {self.url} ({' '.join(self.proc.args[3:])}): {state}\n{self.log()[-tail_chars:]}"

    def stop(self) -> int:
        """Stop the process (SIGINT, then SIGKILL after 10 s) and delete its log file."""
        if self in ServerProcess.running:
            ServerProcess.running.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._final_log = self.log()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except FileNotFoundError:
            pass
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
