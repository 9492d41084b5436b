"""``max_tokens`` ending an answer right after a complete call (a forced call often ends on the
limit's last token) reports the calls (``tool_calls`` / ``tool_use`` / ``completed``), not a cut
answer; a call cut mid-way, a call opener cut (``<tool_``) or text after the last call keeps
``length`` / ``max_tokens`` / ``incomplete``. Scanner level, then the three wires (echo engine,
in process, streamed and not): the echo "model" writes the last user message, byte by byte."""

from __future__ import annotations

import json

import pytest

from echo_app import echo_client
from inprocess import echo_call
from test_output_scanner import CODER, HERMES, LLAMA, check

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = echo_call("get_weather", {"city": "Oslo"})
TWO = CALL + "\n" + echo_call("get_weather", {"city": "Lima"})
# (max_tokens, finish_reason, calls, a call streamed then dropped): TWO cut at each place
CUTS = [(len(CALL), "tool_calls", 1, False),                  # on the call's last byte
        (len(CALL) + 1, "tool_calls", 1, False),              # in the whitespace after it
        (len(CALL) + 1 + len("<tool_"), "length", 1, False),  # the next call's opener cut
        (len(TWO) - 20, "length", 1, True),                   # the next call cut mid-arguments
        (len(CALL) - 20, "length", 0, True)]                  # the only call cut mid-arguments


@pytest.mark.timeout(60)
def test_scanner_length_after_a_complete_call():
    coder = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    for text, options in ((CALL + "\n", HERMES), (coder + "\n  ", CODER),
                          ('{"name": "f", "parameters": {"a": 1}}', LLAMA)):
        out = check(text, options, reason="length")
        assert (len(out.tool_calls), out.finish_reason, out.dropped_calls) == (1, "tool_calls", 0), text
    for text in (CALL + "\n<tool_", CALL + "\n<tool_call>\n{\"name\": \"get_w", TWO[:-20]):
        out = check(text, HERMES, reason="length")
        assert (len(out.tool_calls), out.finish_reason, out.content) == (1, "length", ""), text
        assert out.dropped_calls == 1
    out = check(CALL + "\nAnd then", HERMES, reason="length")  # text after the call was cut
    assert (len(out.tool_calls), out.finish_reason, out.content) == (1, "length", "And then")
    assert check("<tool", HERMES, reason="length").finish_reason == "length"


def chat(client, max_tokens, tool_choice, stream):
    body = {"model": "echo", "messages": [{"role": "user", "content": TWO}], "tools": [WEATHER],
            "tool_choice": tool_choice, "max_tokens": max_tokens, "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["finish_reason"], len(choice["message"].get("tool_calls") or []), \
            choice["message"]["content"]
    finish, calls, content = None, set(), ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                finish = choice.get("finish_reason") or finish
                calls |= {c["index"] for c in choice["delta"].get("tool_calls") or []}
                content += choice["delta"].get("content") or ""
    return finish, len(calls), content


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_finish_reason_at_max_tokens(stream):
    with echo_client() as client:
        for max_tokens, finish, n, _ in CUTS:
            for choice in ("required", "auto"):
                got = chat(client, max_tokens, choice, stream)
                assert got[0] == finish and not got[2], (max_tokens, choice, got)
                if not stream:  # a cut call's start was streamed; the final answer drops it
                    assert got[1] == n, (max_tokens, choice, got)
        assert chat(client, len(CALL), NAMED, stream)[:2] == ("tool_calls", 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_stop_reason_at_max_tokens(stream):
    tools = [{"name": "get_weather", "input_schema": CITY}]
    with echo_client() as client:
        for max_tokens, finish, n, _ in CUTS:
            r = client.post("/v1/messages", json={
                "model": "m", "max_tokens": max_tokens, "tools": tools, "stream": stream,
                "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": TWO}]})
            assert r.status_code == 200, r.text
            if stream:
                deltas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
                stop = [d["delta"]["stop_reason"] for d in deltas if d["type"] == "message_delta"]
                assert stop == ["tool_use" if finish == "tool_calls" else "max_tokens"], max_tokens
            else:
                body = r.json()
                assert body["stop_reason"] == ("tool_use" if finish == "tool_calls" else "max_tokens")
                assert len([b for b in body["content"] if b["type"] == "tool_use"]) == n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_responses_status_at_max_tokens(stream):
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    with echo_client() as client:
        for max_tokens, finish, n, streamed_cut in CUTS:
            r = client.post("/v1/responses", json={"model": "m", "input": TWO, "tools": tools,
                                                   "tool_choice": "required", "stream": stream,
                                                   "max_output_tokens": max_tokens})
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
                body = events[-1]["response"]
                assert events[-1]["type"] == f"response.{body['status']}"
            else:
                body = r.json()
            assert body["status"] == ("completed" if finish == "tool_calls" else "incomplete"), max_tokens
            calls = [i["status"] for i in body["output"] if i["type"] == "function_call"]
            # a call cut mid-way (announced by output_item.added when streamed) ends "incomplete",
            # streamed or not
            assert calls == ["completed"] * n + ["incomplete"] * streamed_cut, max_tokens


@pytest.mark.timeout(60)
def test_the_log_line_says_what_the_client_got(caplog):
    with echo_client() as client, caplog.at_level("INFO", logger="redlite.generation"):
        assert chat(client, len(CALL), "required", False)[0] == "tool_calls"
        assert chat(client, len(CALL) - 20, "required", False)[0] == "length"
    finishes = [m.split("finish ")[1].split(",")[0] for m in caplog.messages if " generated " in m]
    assert finishes == ["tool_calls", "length"]
