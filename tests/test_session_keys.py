"""Session keys, in process on the echo engine: the headers and body fields agents send name
the conversation; a main agent and its sub-agent, interleaved, each keep their state (the
main agent's cached tokens cover its whole previous prompt and answer every turn)."""

from __future__ import annotations

import logging

from echo_app import echo_client
from redlite.server.session_key import session_key_of

MAIN_SYSTEM = {"role": "system", "content": "You are the main agent. " + "Rules. " * 60}
SUB_SYSTEM = {"role": "system", "content": "You are a sub-agent that searches. " + "Find. " * 40}


def ask(client, messages, headers=None, **fields):
    r = client.post("/v1/chat/completions", headers=headers or {},
                    json={"model": "echo", "messages": messages, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"], body["usage"]


def test_session_key_sources():
    assert session_key_of({"x-claude-code-session-id": "a", "session_id": "b"}, "c") == "a"
    assert session_key_of({"session_id": "b"}, "c") == "b"
    assert session_key_of({"session-id": "d"}) == "d"
    assert session_key_of({"x-session-affinity": "e"}, None) == "e"
    assert session_key_of({}, "c") == "c"
    assert session_key_of({}, None) is None


def test_main_and_sub_agent_interleaved_keep_their_state(caplog):
    with echo_client() as client, caplog.at_level(logging.INFO):
        histories = {"main": [MAIN_SYSTEM], "sub": [SUB_SYSTEM]}
        previous = {}
        for turn in range(4):
            for agent, headers, fields in (("main", {"session_id": "main-1"}, {}),
                                           ("sub", {}, {"prompt_cache_key": "sub-7"})):
                history = histories[agent]
                history.append({"role": "user", "content": f"{agent} step {turn}: " + "data " * 30})
                answer, usage = ask(client, history, headers, **fields)
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                if agent in previous:
                    assert cached >= previous[agent], (agent, turn, cached, previous[agent])
                previous[agent] = usage["prompt_tokens"] + usage["completion_tokens"]
                history.append({"role": "assistant", "content": answer["content"]})
        text = "\n".join(caplog.messages)
        assert "session=main-1" in text and "session=sub-7" in text


def test_body_session_field_per_wire():
    from redlite.server.session_key import body_session_value, wire_of_path

    assert wire_of_path("/v1/messages") == "anthropic" and wire_of_path("/v1/responses") == "openai"
    assert body_session_value("anthropic", {"metadata": {"user_id": "u"}}) == "u"
    assert body_session_value("anthropic", {"metadata": None, "prompt_cache_key": "k"}) is None
    assert body_session_value("openai", {"prompt_cache_key": "k", "metadata": {"user_id": "u"}}) == "k"
