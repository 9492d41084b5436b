"""Exact replay on the echo engine, in process: each way a client sends the model's own turn
back differently still gives a plain extension (cached = everything held), the prompt ids equal
a cold server's given the same kept turns, and ``--replay template`` misses (so the tests can
fail). The echo engine repeats the last user or tool message, so a user message holding a call's
text is answered with that call."""

from __future__ import annotations

import json

import pytest

from echo_app import echo_client
from inprocess import echo_call
from redlite.core.chat import ChatRequest
from redlite.server.chat_service import ChatOptions

WRITE = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
SYSTEM = {"role": "system", "content": "You edit files."}
ARGS = {"path": "src/a.py", "content": "print('hi')\n" * 40}


def ask(client, messages, **fields):
    r = client.post("/v1/chat/completions", json={"model": "echo", "messages": messages, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"], body["usage"]


def prompt_ids(client, messages, **fields):
    request = ChatRequest(messages=messages, tools=fields.get("tools", []),
                          template_kwargs=fields.get("chat_template_kwargs", {}))
    return client.state.chat.prepare_sync(request).generation.prompt_ids


def sorted_keys(message):
    out = dict(message)
    out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
        json.loads(c["function"]["arguments"]), sort_keys=True, separators=(",", ":"))}}
        for c in message["tool_calls"]]
    return out


def no_reasoning(message):
    return {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}


CASES = {
    # client re-serializes tool-call arguments with sorted keys and other whitespace
    "sorted-args": (lambda m: sorted_keys(m), {"tools": [WRITE]}, echo_call("write", ARGS), True),
    # client strips reasoning from the replayed turn
    "strip-reasoning": (no_reasoning, {"chat_template_kwargs": {"enable_thinking": True}},
                        "Plan: write it.\n</think>\n\nDone writing the file.", True),
    # content sent back as text (re-tokenization is invisible to the byte tokenizer; the splice
    # keeps the held ids either way)
    "as-text": (lambda m: {"role": "assistant", "content": m["content"]}, {}, "The answer is 42.",
                False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_class_is_a_plain_extension(case):
    change, fields, user_text, template_misses = CASES[case]
    first = [SYSTEM, {"role": "user", "content": user_text}]
    results = {}
    for mode in ("exact", "template"):
        with echo_client(chat_options=ChatOptions(replay=mode)) as client:
            answer, usage1 = ask(client, first, **fields)
            back = change(answer)
            second = first + [back]
            if answer.get("tool_calls"):
                second.append({"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"],
                               "content": "ok"})
            else:
                second.append({"role": "user", "content": "and now?"})
            held = usage1["prompt_tokens"] + usage1["completion_tokens"]
            _, usage2 = ask(client, second, **fields)
            ids = prompt_ids(client, second, **fields)
            results[mode] = (held, usage2["prompt_tokens_details"]["cached_tokens"], ids,
                             client.state.chat.replay)
    held, cached, warm_ids, store = results["exact"]
    assert cached == held  # a plain extension: every held token kept
    if template_misses:  # the template render alone misses
        assert results["template"][1] < results["template"][0]
    # warm == cold: a cold server given the same kept turns renders the same ids
    with echo_client(chat_options=ChatOptions(replay="exact")) as cold:
        cold.state.chat.replay = store
        assert prompt_ids(cold, second, **fields) == warm_ids
        _, usage = ask(cold, second, **fields)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert usage["prompt_tokens"] == len(warm_ids)


def test_trimmed_answer_and_regenerate_rewind_to_the_boundary():
    with echo_client() as client:
        first = [SYSTEM, {"role": "user", "content": "A long answer, then more text here."}]
        answer, usage1 = ask(client, first)
        # regenerate: the same prompt again keeps everything but the last prompt token
        again, usage = ask(client, first)
        assert again["content"] == answer["content"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage1["prompt_tokens"] - 1
        # trimmed answer: not recognised, rendered by the template; reuse up to the trim
        trimmed = first + [{"role": "assistant", "content": answer["content"][:10]},
                           {"role": "user", "content": "go on"}]
        _, usage = ask(client, trimmed)
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage1["prompt_tokens"] + 10


def test_miss_line_names_the_message_and_offset(caplog):
    fields = {"tools": [WRITE]}
    first = [SYSTEM, {"role": "user", "content": echo_call("write", ARGS)}]
    with echo_client(chat_options=ChatOptions(replay="template")) as client:
        answer, _ = ask(client, first, **fields)
        call_id = answer["tool_calls"][0]["id"]
        second = first + [sorted_keys(answer), {"role": "tool", "tool_call_id": call_id, "content": "ok"}]
        caplog.clear()
        with caplog.at_level("INFO", logger="redlite.generation"):
            ask(client, second, **fields)
    line = next(m for m in caplog.messages if "cache miss" in m)
    # the byte template renders '<|assistant|><tool_call>\n{"name": "write", "arguments": {"' then
    # the arguments' first key differs (sorted: content before path)
    prefix = '<|assistant|><tool_call>\n{"name": "write", "arguments": {"'
    assert f"message=2 role=assistant tool_call={call_id} offset={len(prefix)}" in line, line
