"""A client that leaves during a long prefill frees the engine within one prefill chunk, and what
was prefilled is kept: the same prompt sent again continues from there (real server process)."""

import re
import time

import httpx
import pytest

CHUNK = 100           # --prefill-chunk
DELAY_MS = 2.0        # --echo-prefill-delay-ms: one chunk takes 0.2 s
LONG = "0123456789" * 300  # 3,000 prompt tokens: a 6 s prefill


def ask(url, content, timeout=30.0, **fields):
    return httpx.post(url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": content}], **fields}, timeout=timeout)


def test_disconnect_mid_prefill_frees_the_engine_and_keeps_the_prefix(start_server):
    server = start_server("--echo-prefill-delay-ms", str(DELAY_MS), "--prefill-chunk", str(CHUNK))
    with pytest.raises(httpx.TimeoutException):
        ask(server.url, LONG, timeout=1.0)  # leaves 1 s into the 6 s prefill
    left = time.monotonic()
    r = ask(server.url, "next")
    served = time.monotonic() - left
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "next"
    chunk_s = CHUNK * DELAY_MS / 1000
    assert served < chunk_s + 0.5, served  # not the 5 s left of the first prefill
    log = server.wait_for_log("prefill stopped at")
    stopped, total = map(int, re.search(r"prefill stopped at (\d+) of (\d+) tok", log).groups())
    assert 0 < stopped < total and stopped % CHUNK == 0
    again = ask(server.url, LONG, max_tokens=3).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == stopped
    assert again["choices"][0]["message"]["content"] == LONG[:3]


@pytest.mark.model
def test_bundled_model_prefill_stops_when_the_client_leaves(start_server):
    server = start_server("--prefill-chunk", "16", "--ctx-size", "2048", engine="torch", timeout_s=300)
    # llguidance's vocabulary build after start-up holds the GIL: a request sent meanwhile can
    # spend the whole 0.5 s below waiting to be read, never reaching the prefill this tests
    server.wait_for_log("tokenizer tables", timeout_s=60)
    words = "the quick brown fox jumps over the lazy dog " * 160  # about 1,450 tokens
    with pytest.raises(httpx.TimeoutException):
        ask(server.url, words, timeout=0.5, max_tokens=1)
    log = server.wait_for_log("prefill stopped at", timeout_s=30)
    stopped = int(re.search(r"prefill stopped at (\d+) of", log).group(1))
    again = ask(server.url, words, max_tokens=1, temperature=0, timeout=300).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == stopped


def test_server_side_max_tokens_cap(start_server):
    server = start_server("--max-tokens", "3")
    for fields in ({}, {"max_tokens": 50}, {"max_completion_tokens": 2}):
        r = ask(server.url, "a long answer", **fields).json()
        expected = 2 if fields.get("max_completion_tokens") == 2 else 3
        assert r["choices"][0]["message"]["content"] == "a long answer"[:expected]
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == expected
