"""Exact replay and answers whose calls the client never got (echo engine, in process): a call
cut by ``max_tokens`` (or a malformed one) is dropped from the answer, so the client's copy of
the turn lacks its text; the turn is not kept for replay, and the conversation sent back
renders through the template (the unfinished call is not put back into the prompt) while a
complete answer still replays exactly."""

from __future__ import annotations

import logging

import pytest

from echo_app import echo_client
from inprocess import echo_call
from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest
from redlite.core.output_scanner import ParseOptions
from redlite.core.replay import ReplayStore
from redlite.core.replay_record import record_turn
from redlite.engine.base import SamplingParams
from redlite.engine.echo import EchoEngine

WRITE = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
CALL = echo_call("write", {"path": "a.py", "content": "print('hi')\n" * 20})


def ask(client, messages, **fields):
    r = client.post("/v1/chat/completions", json={"model": "echo", "messages": messages,
                                                  "tools": [WRITE], **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0], body["usage"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_call_cut_by_max_tokens_is_not_replayed(caplog, tool_choice):
    with caplog.at_level(logging.INFO), echo_client() as client:
        first = [{"role": "user", "content": CALL}]
        choice, first_usage = ask(client, first, max_tokens=40, tool_choice=tool_choice)
        assert choice["finish_reason"] == "length"
        assert not choice["message"].get("tool_calls")  # the half call is not reported
        store = client.state.chat.replay
        assert len(store) == 0  # nor kept for replay
        # the client sends the conversation back with the (empty) turn it got
        resent = first + [{"role": "assistant", "content": choice["message"]["content"] or ""},
                          {"role": "user", "content": "Try again."}]
        caplog.clear()
        again, usage = ask(client, resent, max_tokens=8, tool_choice="none")
        assert "spliced" not in caplog.text
        # the held half call is not reused: only the first prompt's tokens are
        assert usage["prompt_tokens_details"]["cached_tokens"] <= first_usage["prompt_tokens"]
        assert again["finish_reason"] == "length"


@pytest.mark.timeout(60)
def test_complete_call_is_still_replayed(caplog):
    with caplog.at_level(logging.INFO), echo_client() as client:
        first = [{"role": "user", "content": CALL}]
        choice, usage = ask(client, first, max_tokens=400)
        assert choice["finish_reason"] == "tool_calls"
        assert len(client.state.chat.replay) == 1
        resent = first + [choice["message"], {"role": "tool", "tool_call_id":
                                              choice["message"]["tool_calls"][0]["id"], "content": "ok"}]
        _, again = ask(client, resent, max_tokens=8)
        held = usage["prompt_tokens"] + usage["completion_tokens"]
        assert again["prompt_tokens_details"]["cached_tokens"] >= held


@pytest.mark.timeout(60)
def test_malformed_call_is_not_kept():
    """Without a grammar (a malformed call can only come from free output) the scanner drops a
    broken call; its answer is not kept, a well-formed one is."""
    tok = ByteTokenizer()
    store = ReplayStore()
    for body, kept in (('{"name": "write", "arguments": {"path": a.py}}', 0),
                       ('{"name": "write", "arguments": {"path": "a.py"}}', 1)):
        rendered = tok.render_chat([{"role": "user", "content": f"<tool_call>\n{body}\n</tool_call>"}])
        request = GenerationRequest(list(rendered.token_ids), 200, SamplingParams(),
                                    message_ends=list(rendered.message_ends),
                                    parse=ParseOptions(tool_format="hermes"))
        result = list(Generator(EchoEngine(), tok).run(request))[-1]
        assert result.output.dropped_calls == 1 - kept
        turn = record_turn(store, tok, request, result)
        assert (turn is not None, len(store)) == (bool(kept), kept)
