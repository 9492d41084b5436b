"""Forced tool calls end (echo engine, in process, over the three wires): ``tool_choice:
"required"`` is at least one call, not a call after a call until ``max_tokens``; a forced
function whose schema does not forbid extra keys still closes its arguments. The echo engine
repeats the last user message, so that message scripts what the "model" tries to write; the
grammar decides what it may."""

from __future__ import annotations

import json

import pytest

from echo_app import echo_client
from inprocess import echo_call
from redlite.core.constraints import MAX_FORCED_CALLS

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: takes none
DISTINCT = "\n".join(echo_call("get_weather", {"city": f"c{i}"}) for i in range(12))
SAME = "\n".join([echo_call("ping", {})] * 12)
# (ending as a call does: the echo "model" then prefers the call's markup to a <think> block)
EXTRA_KEYS = '{"city": "Lima", ' + ", ".join(f'"k{i}": "v{i}"' for i in range(80)) + "}}\n</tool_call>"


def chat(client, content, stream=False, **fields):
    """(finish_reason, [(name, arguments)]) of one chat completion."""
    body = {"model": "echo", "messages": [{"role": "user", "content": content}],
            "tools": [WEATHER, PING], "max_tokens": 2000, "stream": stream, **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return choice["finish_reason"], [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                         for c in calls]
    calls, finish = {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            finish = choice.get("finish_reason") or finish
            for call in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
    return finish, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_are_capped_and_end(stream):
    with echo_client() as client:
        finish, calls = chat(client, DISTINCT, stream, tool_choice="required")
        assert finish == "tool_calls"
        assert calls == [("get_weather", {"city": f"c{i}"}) for i in range(MAX_FORCED_CALLS)]
        finish, calls = chat(client, DISTINCT, stream, tool_choice="required", parallel_tool_calls=False)
        assert (finish, calls) == ("tool_calls", [("get_weather", {"city": "c0"})])
        # a newline after the call no longer forces another one
        finish, calls = chat(client, echo_call("get_weather", {"city": "Oslo"}) + "\nThat is all.",
                             stream, tool_choice="required")
        assert (finish, calls) == ("tool_calls", [("get_weather", {"city": "Oslo"})])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_call_ends_the_answer(stream):
    """A model in a loop writes the same call again: the answer ends there (streamed and
    non-streamed agree), in ``required`` and ``auto`` alike."""
    with echo_client() as client:
        for choice in ("required", "auto"):
            finish, calls = chat(client, SAME, stream, tool_choice=choice)
            assert (finish, calls) == ("tool_calls", [("ping", {})] * 2), choice


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_with_open_schema_closes(stream):
    with echo_client() as client:
        finish, calls = chat(client, EXTRA_KEYS, stream, max_tokens=200,
                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert (finish, calls) == ("tool_calls", [("get_weather", {"city": "Lima"})])


@pytest.mark.timeout(60)
def test_anthropic_any_and_forced_tool():
    tools = [{"name": "get_weather", "input_schema": CITY}]
    with echo_client() as client:
        def ask(content, choice):
            r = client.post("/v1/messages", json={"model": "m", "max_tokens": 2000, "tools": tools,
                                                  "tool_choice": choice,
                                                  "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 200, r.text
            body = r.json()
            return body["stop_reason"], [b["input"] for b in body["content"] if b["type"] == "tool_use"]
        stop, inputs = ask(DISTINCT, {"type": "any"})
        assert stop == "tool_use" and inputs == [{"city": f"c{i}"} for i in range(MAX_FORCED_CALLS)]
        assert ask(DISTINCT, {"type": "any", "disable_parallel_tool_use": True}) == ("tool_use", [{"city": "c0"}])
        assert ask(EXTRA_KEYS, {"type": "tool", "name": "get_weather"}) == ("tool_use", [{"city": "Lima"}])


@pytest.mark.timeout(60)
def test_responses_required_calls_end():
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    with echo_client() as client:
        r = client.post("/v1/responses", json={"model": "m", "input": DISTINCT, "tools": tools,
                                               "tool_choice": "required", "max_output_tokens": 2000})
        assert r.status_code == 200, r.text
        body = r.json()
        calls = [json.loads(i["arguments"]) for i in body["output"] if i["type"] == "function_call"]
        assert body["status"] == "completed" and calls == [{"city": f"c{i}"} for i in range(MAX_FORCED_CALLS)]


@pytest.mark.timeout(60)
def test_a_tool_whose_schema_cannot_be_compiled_is_named():
    """A forced call over several tools, one with a pattern llguidance rejects (a lookahead):
    the 400 names that tool, on the chat and the Anthropic routes."""
    bad = {"type": "object", "properties": {"path": {"type": "string", "pattern": "^(?!foo).*$"}}}
    with echo_client() as client:
        r = client.post("/v1/chat/completions", json={
            "model": "echo", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "tools": [WEATHER, {"type": "function", "function": {"name": "read_file", "parameters": bad}}]})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "tools" and error["message"].startswith("tool 'read_file': cannot build"), error
        r = client.post("/v1/messages", json={
            "model": "m", "max_tokens": 20, "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "get_weather", "input_schema": CITY}, {"name": "read_file", "input_schema": bad}]})
        assert r.status_code == 400 and "tool 'read_file'" in r.json()["error"]["message"], r.text
