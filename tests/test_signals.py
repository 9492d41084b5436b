"""SIGINT/SIGTERM at each phase of a real server process: exit status 0, never an abort; the
running request gets 503 (JSON, or an SSE error event then ``data: [DONE]``), waiting ones get
503; conversations are saved to --session-dir; a second signal exits at once, cleanly."""

import json
import logging
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

CUT = "server is shutting down; the answer was cut off"
DOWN = "server is shutting down"


def user(content):
    return {"messages": [{"role": "user", "content": content}]}


class Client(threading.Thread):
    """One request in a thread: ``status``/``body`` (JSON) or ``lines`` (a stream), ``error``."""

    def __init__(self, url, body, stream=False, timeout=60):
        super().__init__(daemon=True)
        self.url, self.body, self.stream, self.timeout = url, body, stream, timeout
        self.status = self.payload = self.error = None
        self.lines = []
        self.start()

    def run(self):
        try:
            if self.stream:
                with httpx.stream("POST", self.url + "/v1/chat/completions",
                                  json={**self.body, "stream": True}, timeout=self.timeout) as r:
                    self.status = r.status_code
                    self.lines.extend(line for line in r.iter_lines() if line)
            else:
                r = httpx.post(self.url + "/v1/chat/completions", json=self.body, timeout=self.timeout)
                self.status, self.payload = r.status_code, r.json()
        except (httpx.HTTPError, ValueError) as error:
            self.error = error

    def result(self, timeout=30):
        self.join(timeout)
        assert not self.is_alive(), "client still waiting"
        assert self.error is None, self.error
        return self

    def message(self):
        if self.stream:
            assert self.lines[-1] == "data: [DONE]", self.lines
            return json.loads(self.lines[-2].removeprefix("data: "))["error"]["message"]
        assert self.status == 503, (self.status, self.payload)
        return self.payload["error"]["message"]


def exit_status(server, timeout=30):
    code = server.proc.wait(timeout)
    log = server.log()
    assert "terminate called" not in log and "Traceback" not in log, log
    return code


def wait_queued(server, n, timeout=10):
    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health", timeout=5).json()["queue_depth"] < n:
        assert time.monotonic() < deadline, "requests not queued"
        time.sleep(0.02)


def files(directory):
    """The session files in ``directory``; asserts no temporary (half-written) file is left."""
    names = sorted(p.name for p in Path(directory).iterdir() if p.is_file())
    assert not [n for n in names if n.endswith(".tmp")], names
    return [n for n in names if n.endswith(".rlsession")]


def ask(server, content):
    r = httpx.post(server.url + "/v1/chat/completions", json=user(content), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sig, stream", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_signal_during_prefill(start_server, tmp_path, sig, stream):
    server = start_server("--echo-prefill-delay-ms", "2", "--prefill-chunk", "50",
                          "--session-dir", str(tmp_path), "--session-min-tokens", "20")
    ask(server, "parked conversation " * 3)  # will be parked in RAM by the next one
    running = Client(server.url, user("x" * 3000), stream=stream)  # a 6 s prefill
    server.wait_for_log("reason=token-mismatch")  # its cache-miss line: logged before a long prefill
    waiting = Client(server.url, user("queued"))
    wait_queued(server, 1)
    time.sleep(0.3)
    server.signal(sig)
    assert running.result().message() == CUT
    assert waiting.result().message() == DOWN
    assert exit_status(server) == 0
    log = server.log()
    assert "prefill stopped at" in log
    saved = files(tmp_path)
    assert len(saved) == 2, saved  # the RAM-parked conversation and the live one
    restarted = start_server("--session-dir", str(tmp_path))
    assert "2 saved conversations indexed" in restarted.log()


def test_signal_while_queued_and_decoding_stream(start_server):
    server = start_server("--echo-delay-ms", "50")
    running = Client(server.url, user("z" * 200), stream=True)
    server.wait_for_log("prefill")
    waiting = [Client(server.url, user(f"wait {i}")) for i in range(2)]
    wait_queued(server, 2)
    server.signal(signal.SIGTERM)
    assert running.result().message() == CUT
    assert len(running.lines) < 200
    assert [w.result().message() for w in waiting] == [DOWN, DOWN]
    assert exit_status(server) == 0
    assert server.log().rstrip().endswith("stopped (exit status 0)")
    # the cut stream's access line is written once its generation stopped: with its counts
    lines = [line for line in server.log().splitlines() if "POST /v1/chat/completions 200" in line]
    assert len(lines) == 1 and " generated=" in lines[0], lines


def test_signal_while_the_body_is_decoded_and_rendered(start_server):
    server = start_server("--max-body-mib", "64")
    body = {"messages": [{"role": "user", "content": f"m{i}"} for i in range(100_000)]}  # < 1M tokens
    raw = json.dumps(body).encode()
    gate, result = threading.Event(), {}

    def content():  # half the body, then the rest once the signal was sent: always in flight
        yield raw[: len(raw) // 2]
        gate.wait(30)
        yield raw[len(raw) // 2:]

    def send():
        try:
            r = httpx.post(server.url + "/v1/chat/completions", content=content(), timeout=60,
                           headers={"content-type": "application/json"})
            result["status"], result["payload"] = r.status_code, r.json()
        except (httpx.HTTPError, ValueError) as error:
            result["error"] = error

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(0.5)  # the first half is read; the server waits for the rest
    server.signal(signal.SIGINT)
    time.sleep(0.2)
    gate.set()  # the rest is read, decoded, validated and rendered after the signal
    sender.join(60)
    assert not sender.is_alive() and "error" not in result, result
    assert result["status"] == 503 and result["payload"]["error"]["message"] == DOWN, result
    assert exit_status(server) == 0


def test_signal_while_parking(start_server, tmp_path):
    server = start_server("--echo-snapshot-delay-ms", "1500", "--session-dir", str(tmp_path),
                          "--session-min-tokens", "1")
    ask(server, "first conversation")
    running = Client(server.url, user("another conversation"))  # parks the first: 1.5 s copy
    time.sleep(0.5)
    server.signal(signal.SIGINT)
    assert running.result().message() == CUT
    assert exit_status(server) == 0
    assert len(files(tmp_path)) == 1  # the parked conversation reached the disk


def test_second_signal_exits_at_once_without_half_written_files(start_server, tmp_path):
    server = start_server("--echo-snapshot-delay-ms", "4000", "--session-dir", str(tmp_path),
                          "--session-min-tokens", "1")
    ask(server, "a conversation to save at exit")
    server.signal(signal.SIGINT)
    server.wait_for_log("stopping (a second signal")
    time.sleep(0.5)  # the exit save is copying the live state (4 s)
    second = time.monotonic()
    server.signal(signal.SIGINT)
    assert exit_status(server, timeout=10) == 0
    assert time.monotonic() - second < 2.0  # not the 3.5 s left of the copy
    assert files(tmp_path) == []  # nothing started, nothing half-written


def test_signal_while_loading_exits_zero():
    import subprocess
    import sys
    from server_process import free_port
    proc = subprocess.Popen([sys.executable, "-m", "redlite.cli", "serve", "--port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("loading engine" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        proc.send_signal(signal.SIGTERM)  # importing torch, loading the model
        out = "".join(lines) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert out.rstrip().endswith("stopped (exit status 0)"), out
    assert "Traceback" not in out and "listening on" not in out


@pytest.mark.model
@pytest.mark.parametrize("twice", [False, True])
def test_bundled_model_signal_mid_prefill_exits_zero_without_abort(start_server, tmp_path, twice):
    server = start_server("--ctx-size", "4096", "--session-dir", str(tmp_path),
                          "--session-min-tokens", "16", engine="torch", timeout_s=300)
    prompt = "the quick brown fox jumps over the lazy dog " * 300  # ~2,700 tokens
    running = Client(server.url, {**user(prompt), "max_tokens": 4}, timeout=300)
    server.wait_for_log("engine", timeout_s=5)
    time.sleep(1.5)  # inside the prefill (chunks of 512 tokens)
    server.signal(signal.SIGINT)
    if twice:
        time.sleep(0.2)
        server.signal(signal.SIGTERM)
    assert running.result(120).message() == CUT
    assert exit_status(server, timeout=120) == 0
    log = server.log()
    if not twice:
        assert "prefill stopped at" in log
        assert len(files(tmp_path)) == 1  # the prefilled part, saved
    files(tmp_path)  # no temporary file left


def test_signals_are_ignored_once_serve_has_returned():
    """Finalizing the interpreter puts the default action back for Python-handled signals, so a
    second signal arriving after the stop was done (while the process exits) would kill it with
    -15; from the return of ``serve`` on the signals are ignored instead (the exit is underway)."""
    import gc
    import socket

    from redlite.cli import main
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:  # a busy port: serve returns 1 before loading anything
        assert main(["serve", "--engine", "echo", "--port", str(busy.getsockname()[1])]) == 1
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        busy.close()
        gc.enable()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_forced_exit_before_the_lifespan_shutdown_logs_no_traceback():
    """A second signal right after the first sets uvicorn's force_exit before its shutdown
    reaches the lifespan's: the lifespan task, left waiting, was cancelled when the loop closed
    and uvicorn logged the CancelledError's traceback (a CI failure). Served as ``serve``
    configures uvicorn, the forced exit logs no error."""
    import socket

    from echo_app import echo_state
    from redlite.server.app import create_app
    from redlite.server.run import Stopper, _Server, uvicorn_config

    class Errors(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    state = echo_state()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn_config(create_app(state), "127.0.0.1", listener.getsockname()[1], 10.0)
    errors = Errors()  # uvicorn's loggers do not propagate to the root logger
    logging.getLogger("uvicorn.error").addHandler(errors)
    server = _Server(config, Stopper(), lambda: 0.0)
    runner = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    try:
        runner.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and runner.is_alive(), "server did not start"
            time.sleep(0.01)
        server.stop()
        server.force()
        runner.join(10)
        assert not runner.is_alive()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
        listener.close()
        state.worker.shutdown(wait_s=2.0)
    assert errors.messages == []
