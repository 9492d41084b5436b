"""FIFO queue, overload, disconnects and shutdown, against real server processes.

The echo engine is slowed to a fixed per-token delay (``--echo-delay-ms``) so timing is
deterministic: an answer of N bytes takes about N x delay.
"""

import re
import signal
import socket
import threading
import time

import httpx

from redlite.core.byte_tokenizer import ByteTokenizer


def body(content, **fields):
    return {"messages": [{"role": "user", "content": content}], **fields}


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
    for i in range(4):
        threads.append(post_in_thread(server.url, body(f"request number {i}"), results, i))
        time.sleep(0.1)  # fixes the arrival order
    health_times = []
    for _ in range(5):
        started = time.monotonic()
        health = httpx.get(server.url + "/health", timeout=5).json()
        health_times.append(time.monotonic() - started)
        assert health["busy"] is True
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    assert max(health_times) < 0.5, health_times
    assert all(results[i][0] == 200 for i in range(4)), results
    finished = [results[i][2] for i in range(4)]
    assert finished == sorted(finished)
    assert [results[i][1]["choices"][0]["message"]["content"] for i in range(4)] == \
        [f"request number {i}" for i in range(4)]


def test_queue_limit_gives_503_busy(start_server):
    server = start_server("--echo-delay-ms", "30", "--queue", "1")
    results = {}
    threads = [post_in_thread(server.url, body("x" * 20), results, i) for i in range(3)]
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
    running = post_in_thread(server.url, body("y" * 15), results, "running")
    time.sleep(0.15)
    try:
        httpx.post(server.url + "/v1/chat/completions", json=body("GONE-CLIENT"), timeout=0.2)
    except httpx.TimeoutException:
        pass  # the client gives up while its request waits in the queue
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
            lines.extend(line for line in r.iter_lines() if line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(0.3)
    waiting = [post_in_thread(server.url, body(f"wait {i}"), results, i) for i in range(2)]
    time.sleep(0.3)
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
        time.sleep(0.1)
        started = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", json=body("normal request"), timeout=10)
        elapsed = time.monotonic() - started
        assert r.status_code == 200
        assert elapsed < baseline + 0.2, (elapsed, baseline)
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
    time.sleep(0.4)
    server.signal(signal.SIGINT)
    running.join(5)
    status, payload, _, _ = results["running"]
    assert status == 503
    assert payload["error"]["message"] == "server is shutting down; the answer was cut off"
    assert server.proc.wait(5) == 0
