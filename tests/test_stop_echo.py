"""Stop sequences through a real server with the echo engine (issue: stop sequences and exact
streamed text). The echo engine emits one UTF-8 byte per token, so every multi-byte character
and every stop string is split across tokens."""

import httpx
import pytest

from test_api_echo import stream_text


def both(server, content, stop, **fields):
    """(non-streamed content, finish_reason), after checking the stream gives the same."""
    body = {"messages": [{"role": "user", "content": content}], "stop": stop, **fields}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()
    text, finish, _ = stream_text(server.url, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    assert (text, finish) == (choice["message"]["content"], choice["finish_reason"])
    return text, finish


@pytest.mark.parametrize("content,stop,expected", [
    ("Hello World and more", "lo W", "Hel"),
    ("one two three four", ["three", "two"], "one "),        # earliest start wins
    ("abcdef", ["bcd", "abcz"], "a"),                        # a longer partial match that fails
    ("first。second", "。", "first"),
    ("smile 🙂 please", ["🙂"], "smile "),
    ("über alles", ["ü"], ""),                                 # stop at the very first token
    ("naïve café", ["é"], "naïve caf"),
])
def test_stop_sequences(echo_server, content, stop, expected):
    assert both(echo_server, content, stop) == (expected, "stop")


def test_partial_match_is_flushed_when_generation_ends_by_length(echo_server):
    # "wor" is held back as a possible start of "world!", then released at max_tokens
    assert both(echo_server, "hello world", ["world!"], max_tokens=9) == ("hello wor", "length")
    # and at the end of turn
    assert both(echo_server, "hello wor", ["world!"]) == ("hello wor", "stop")


def test_completions_endpoint_honours_stop(echo_server):
    r = httpx.post(echo_server.url + "/v1/completions",
                   json={"prompt": "alpha;beta", "stop": ";", "max_tokens": 20}).json()
    assert r["choices"][0]["text"] == "alpha"
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], [""], "é" * 129, 7, {"x": 1}, [1]])
def test_invalid_stop_values(echo_server, stop):
    for path, payload in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                          ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(echo_server.url + path, json={**payload, "stop": stop})
        assert r.status_code == 400
        param = r.json()["error"]["param"]
        assert param == "stop" or param.startswith("stop.")  # stop.0: the offending item


def test_256_byte_stop_is_accepted(echo_server):
    r = httpx.post(echo_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "stop": "é" * 128})
    assert r.status_code == 200
