"""FIFO queue, overload, disconnects and shutdown, against real server processes.

The echo engine is slowed to a fixed per-token delay (``--echo-delay-ms``) so that requests
stay running or queued while the test acts; the test waits on what the server reports
(``/health``'s ``busy`` and ``queue_depth``, log lines, received stream lines), never on a
fixed sleep, so a slow machine changes how long it takes, not the outcome.
"""

import json
import re
import signal
import socket
import threading
import time

import httpx

from redlite.core.byte_tokenizer import ByteTokenizer


def body(content, **fields):
    return {"messages": [{"role": "user", "content": content}], **fields}


def wait_until(predicate, timeout_s=10.0, what="condition"):
    """Poll ``predicate`` until it is true; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def health(server, client=httpx):
    return client.get(server.url + "/health", timeout=5).json()


def wait_for_queue(server, depth):
    """Until the engine is busy with one request and ``depth`` more wait in the queue."""
    with httpx.Client() as client:  # one connection: each poll is quick even on a busy machine
        wait_until(lambda: (h := health(server, client))["busy"] and h["queue_depth"] == depth,
                   what=f"busy with {depth} queued")


def post_in_thread(url, payload, results, key, timeout=30):
    def run():
        try:
            r = httpx.post(url + "/v1/chat/completions", json=payload, timeout=timeout)
            results[key] = (r.status_code, r.json(), time.monotonic(), r.headers)
        except Exception as error:  # recorded for the assertion message
            results[key] = ("error", repr(error), time.monotonic(), {})
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_fifo_order_and_health_while_busy(start_server):
    server = start_server("--echo-delay-ms", "40")
    results, threads = {}, []
    # the first answer (~3 s) keeps the engine busy while the others queue up, in order
    contents = ["request number 0" + " (a long one)" * 6] + [f"request number {i}" for i in (1, 2, 3)]
    for i, content in enumerate(contents):
        threads.append(post_in_thread(server.url, body(content), results, i))
        wait_for_queue(server, i)  # fixes the arrival order
    health_times = []
    for _ in range(5):
        started = time.monotonic()
        state = health(server)
        health_times.append(time.monotonic() - started)
        assert state["busy"] is True
    for thread in threads:
        thread.join()
    assert max(health_times) < 1.0, health_times  # not queued behind the ~2.5 s of work
    assert all(results[i][0] == 200 for i in range(4)), results
    finished = [results[i][2] for i in range(4)]
    assert finished == sorted(finished)
    assert [results[i][1]["choices"][0]["message"]["content"] for i in range(4)] == contents


def test_queue_limit_gives_503_busy(start_server):
    server = start_server("--echo-delay-ms", "30", "--queue", "1")
    results, threads = {}, []
    for i, size in enumerate((100, 20)):  # a long one running, then one waiting: queue full
        threads.append(post_in_thread(server.url, body("x" * size), results, i))
        wait_for_queue(server, i)
    threads.append(post_in_thread(server.url, body("x" * 20), results, 2))
    for thread in threads:
        thread.join()
    statuses = sorted(r[0] for r in results.values())
    assert statuses == [200, 200, 503], results
    refused = next(r for r in results.values() if r[0] == 503)
    assert refused[1]["error"]["message"] == "server busy"
    assert refused[3]["retry-after"] == "1"


def test_queued_client_that_disconnects_is_never_executed(start_server):
    server = start_server("--echo-delay-ms", "40")
    results = {}
    running = post_in_thread(server.url, body("y" * 60), results, "running")  # ~2.4 s
    wait_for_queue(server, 0)
    payload = json.dumps(body("GONE-CLIENT")).encode()
    gone = socket.create_connection(("127.0.0.1", server.port))
    gone.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    wait_for_queue(server, 1)
    gone.close()  # the client gives up while its request waits in the queue
    running.join()
    log = server.wait_for_log("skipped: client closed the connection while waiting")
    assert results["running"][0] == 200
    assert log.count(" prefill ") == 1  # only the first request reached the engine
    assert httpx.get(server.url + "/health").json()["queue_depth"] == 0


def test_disconnect_mid_stream_frees_worker_and_state_stays_consistent(start_server):
    delay = 0.1
    server, cold = start_server("--echo-delay-ms", str(delay * 1000)), start_server()
    long_text = "abcdefghijklmnopqrstuvwxyz" * 3
    first = body(long_text, stream=True)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=first, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    closed_at = time.monotonic()
    log = server.wait_for_log("finish cancelled", timeout_s=2)
    # the worker is free again within about one token's time
    follow = body(long_text[:5], max_tokens=1)
    r = httpx.post(server.url + "/v1/chat/completions", json=follow, timeout=30)
    assert time.monotonic() - closed_at < 1.0 + 3 * delay
    held = int(re.search(r"finish cancelled, held (\d+) tok", log).group(1))
    prompt = ByteTokenizer().render_chat(first["messages"]).token_ids
    assert len(prompt) < held < len(prompt) + len(long_text)
    # a continuation of exactly what is held is a pure extension with cached == held
    partial = long_text[: held - len(prompt)]
    messages = first["messages"] + [{"role": "assistant", "content": partial},
                                    {"role": "user", "content": "next"}]
    warm = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=30).json()
    assert warm["choices"][0]["message"]["content"] == "next"
    reference = httpx.post(cold.url + "/v1/chat/completions", json={"messages": messages}).json()
    assert warm["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    assert r.status_code == 200


def test_disconnect_mid_stream_then_extension_reports_held_length(start_server):
    server = start_server("--echo-delay-ms", "50")
    text = "0123456789" * 4
    first = body(text, stream=True)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=first, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 8:
                break
    log = server.wait_for_log("finish cancelled", timeout_s=2)
    held = int(re.search(r"finish cancelled, held (\d+) tok", log).group(1))
    prompt = ByteTokenizer().render_chat(first["messages"]).token_ids
    partial = text[: held - len(prompt)]
    messages = first["messages"] + [{"role": "assistant", "content": partial},
                                    {"role": "user", "content": "more"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=30).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == held


def test_sigint_ends_stream_refuses_waiting_and_exits_zero(start_server):
    server = start_server("--echo-delay-ms", "50")
    results, lines = {}, []

    def stream():
        with httpx.stream("POST", server.url + "/v1/chat/completions",
                          json=body("z" * 200, stream=True), timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_until(lambda: len(lines) >= 2, what="the stream's first lines")
    waiting = [post_in_thread(server.url, body(f"wait {i}"), results, i) for i in range(2)]
    wait_for_queue(server, 2)
    signalled = time.monotonic()
    server.signal(signal.SIGINT)
    server.proc.wait(timeout=5)
    assert time.monotonic() - signalled < 5
    assert server.proc.returncode == 0
    streamer.join(5)
    for thread in waiting:
        thread.join(5)
    assert lines and lines[-1] == "data: [DONE]"
    assert len(lines) < 200
    assert "server is shutting down" in lines[-2]  # the client learns the answer was cut
    for i in range(2):
        status, payload, _, _ = results[i]
        assert status == 503, results
        assert payload["error"]["message"] == "server is shutting down"


def test_half_header_client_does_not_delay_others(start_server):
    server = start_server()
    started = time.monotonic()
    httpx.post(server.url + "/v1/chat/completions", json=body("baseline"), timeout=10)
    baseline = time.monotonic() - started
    stalled = socket.create_connection(("127.0.0.1", server.port))
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
    try:
        started = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", json=body("normal request"), timeout=10)
        elapsed = time.monotonic() - started
        assert r.status_code == 200
        assert elapsed < baseline + 1.0, (elapsed, baseline)  # the header timeout is far longer
    finally:
        stalled.close()


def test_connection_with_incomplete_headers_is_closed_after_the_header_timeout(start_server):
    server = start_server("--header-timeout-s", "0.5")
    stalled = socket.create_connection(("127.0.0.1", server.port))
    stalled.settimeout(5)
    try:
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: loc")
        started = time.monotonic()
        assert stalled.recv(1024) == b""  # closed by the server
        assert 0.3 < time.monotonic() - started < 3
    finally:
        stalled.close()
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigint_cuts_a_running_non_streamed_request_with_503(start_server):
    server = start_server("--echo-delay-ms", "50")
    results = {}
    running = post_in_thread(server.url, body("q" * 100), results, "running")
    server.wait_for_log(" prefill ")
    wait_for_queue(server, 0)
    server.signal(signal.SIGINT)
    running.join(5)
    status, payload, _, _ = results["running"]
    assert status == 503
    assert payload["error"]["message"] == "server is shutting down; the answer was cut off"
    assert server.proc.wait(5) == 0
