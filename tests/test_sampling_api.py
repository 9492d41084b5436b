"""The sampling fields over HTTP, in process (ASGI app + echo engine): legacy completions with
n and logprobs (streamed and not), logit_bias / penalties validation, chat response_format."""

import json

import pytest
from fastapi.testclient import TestClient

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import Generator
from redlite.core.worker import EngineWorker
from redlite.engine.echo import EchoEngine
from redlite.server.app import ServerState, create_app


@pytest.fixture(scope="module")
def client():
    engine = EchoEngine()
    worker = EngineWorker(Generator(engine, ByteTokenizer()), max_queue=4)
    state = ServerState(worker, ByteTokenizer(), engine.model_id, engine.max_context)
    with TestClient(create_app(state), raise_server_exceptions=False) as c:
        c.engine = engine
        yield c
    worker.shutdown(wait_s=2.0)


def post(client, path, **body):
    return client.post(path, json=body)


def sse(response):
    lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completions_n_choices(client):
    before = client.engine.prefilled_tokens
    r = post(client, "/v1/completions", prompt="twice", max_tokens=10, n=3, temperature=0.8, seed=1)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["twice"] * 3
    assert body["usage"]["completion_tokens"] == 15 and body["usage"]["prompt_tokens"] == 5
    assert client.engine.prefilled_tokens - before <= 5 + 2  # the prompt was read once


def test_completions_logprobs(client):
    r = post(client, "/v1/completions", prompt="abc", max_tokens=3, logprobs=2)
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"] and lp["text_offset"] == [0, 1, 2]
    assert all(v < 0 for v in lp["token_logprobs"])
    assert list(lp["top_logprobs"][0]) == ["a", "<|end|>"]
    assert post(client, "/v1/completions", prompt="abc").json()["choices"][0]["logprobs"] is None


def test_completions_stream_n_and_logprobs(client):
    r = post(client, "/v1/completions", prompt="hey", max_tokens=5, n=2, logprobs=0, stream=True,
             stream_options={"include_usage": True})
    chunks = sse(r)
    texts = {0: "", 1: ""}
    tokens = {0: [], 1: []}
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        tokens[choice["index"]] += choice["logprobs"]["tokens"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "hey", 1: "hey"} and tokens == {0: list("hey"), 1: list("hey")}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_logit_bias_and_penalties(client):
    r = post(client, "/v1/completions", prompt="abc", max_tokens=3, logit_bias={str(ord("b")): -100})
    assert r.json()["choices"][0]["text"] == "a"
    r = post(client, "/v1/completions", prompt="aaaa", max_tokens=4, presence_penalty=2.0,
             frequency_penalty=0.5, repetition_penalty=1.2)
    # 'a': 10 / 1.2 (in the prompt) - 0.5 * k - 2 after k 'a's: 5.33 at k=2, 4.83 at k=3, below
    # <|end|>'s 5 (not in a raw completion prompt)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaa"


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias.1"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 17}, "n"),
])
def test_completions_field_errors(client, body, param):
    r = post(client, "/v1/completions", prompt="abc", **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_logprobs_field_errors(client):
    r = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], logprobs=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_chat_response_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": '{"n": 42} extra'}],
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == '{"n": 42}'
    r = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}],
             response_format={"type": "yaml"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}],
             response_format={"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def chat_body(content, **fields):
    return {"messages": [{"role": "user", "content": content}], **fields}


def test_chat_logprobs(client):
    r = client.post("/v1/chat/completions", json=chat_body("hi!", logprobs=True, top_logprobs=2))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == ["h", "i", "!"]
    assert content[0]["bytes"] == [ord("h")] and content[0]["logprob"] < 0
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["h", "<|end|>"]
    plain = client.post("/v1/chat/completions", json=chat_body("hi!")).json()
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_streamed(client):
    r = client.post("/v1/chat/completions", json=chat_body("abc", logprobs=True, stream=True))
    tokens, text = [], ""
    for chunk in sse(r):
        (choice,) = chunk["choices"]
        text += choice["delta"].get("content") or ""
        tokens += [e["token"] for e in choice["logprobs"]["content"]]
    assert text == "abc" and tokens == ["a", "b", "c"]


def test_chat_n_choices(client):
    r = client.post("/v1/chat/completions", json=chat_body("same", n=3, temperature=1.0, seed=2))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["same"] * 3
    assert body["usage"]["completion_tokens"] == 12
    r = client.post("/v1/chat/completions", json=chat_body("two", n=2, stream=True,
                                                           stream_options={"include_usage": True}))
    chunks = sse(r)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "two", 1: "two"} and finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["completion_tokens"] == 6


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}


def test_chat_required_tool_call_is_schema_valid(client):
    # the echo's source has no call at all: the grammar writes the markup, the schema's keys
    r = client.post("/v1/chat/completions", json=chat_body(
        "Paris", tools=[WEATHER], tool_choice="required", max_tokens=120,
        chat_template_kwargs={"enable_thinking": False}))
    message = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls", message
    (call,) = message["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and set(arguments) == {"city", "days"}
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int)
