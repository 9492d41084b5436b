"""Errors inside a stream carry the request id, as the JSON errors do: the echo engine fails on
``FAIL!`` after the stream has started, on every streaming surface (chat completions,
completions, Anthropic Messages, Responses); the id is the response's ``x-request-id``."""

import json

import pytest

from sdk_app import EchoApp


@pytest.fixture(scope="module")
def echo():
    with EchoApp() as app:
        yield app


def frames(echo, path, body):
    with echo.client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        return r.headers["x-request-id"], lines


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL!"}]}),
    ("/v1/completions", {"prompt": "FAIL!"}),
])
def test_openai_stream_error_event_has_the_request_id(echo, path, body):
    request_id, lines = frames(echo, path, {"model": "m", "stream": True, **body})
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "engine_error" and error["request_id"] == request_id
    assert request_id.startswith("req_")
    # the same failure answered as JSON names the same kind of id
    r = echo.client.post(path, json={"model": "m", **body})
    assert r.status_code == 500 and r.json()["error"]["request_id"] == r.headers["x-request-id"]


def test_anthropic_stream_error_event_has_the_request_id(echo):
    request_id, lines = frames(echo, "/v1/messages", {
        "model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "FAIL!"}]})
    last = json.loads(lines[-1])
    assert last["type"] == "error" and last["request_id"] == request_id


def test_responses_failed_event_has_the_request_id(echo):
    request_id, lines = frames(echo, "/v1/responses", {"model": "m", "stream": True, "input": "FAIL!"})
    last = json.loads(lines[-1])
    assert last["type"] == "response.failed"
    assert last["response"]["error"]["request_id"] == request_id
