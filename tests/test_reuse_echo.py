"""Reuse reporting and exactness against real server processes with the echo engine.

With the echo engine the held state after a turn is exactly: the rendered prompt plus every
answer byte (the end-of-turn token is not fed back), so cached_tokens can be predicted exactly.
"""

import httpx
import pytest

from redlite.core.byte_tokenizer import ByteTokenizer

tok = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are terse."}


def ask(server, messages, **fields):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, **fields}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt_len(messages):
    return len(tok.render_chat(messages).token_ids)


def turn(user, answer=None):
    out = [{"role": "user", "content": user}]
    if answer is not None:
        out.append({"role": "assistant", "content": answer})
    return out


def test_extension_is_reused_and_exact(start_server):
    warm, cold = start_server(), start_server("--no-reuse")
    first = [SYSTEM, *turn("What is a lighthouse?")]
    answers = {}
    for name, server in (("warm", warm), ("cold", cold)):
        answer1, cached1 = ask(server, first)
        assert cached1 == 0
        second = first + [{"role": "assistant", "content": answer1}, *turn("Which detail matters?")]
        answer2, cached2 = ask(server, second)
        answers[name] = (answer1, answer2, cached2)
    assert answers["warm"][:2] == answers["cold"][:2]
    assert answers["warm"][2] == prompt_len(first) + len(answers["warm"][0].encode())
    assert answers["cold"][2] == 0
    assert "reason=disabled" in cold.log()


@pytest.mark.parametrize("rewindable", [True, False])
def test_edited_turn_repeated_prompt_and_stop_cut(start_server, rewindable):
    args = () if rewindable else ("--echo-no-rewind", "--checkpoint-mib", "0")
    server = start_server(*args)
    first = [SYSTEM, *turn("hello world")]
    answer, _ = ask(server, first)
    held = prompt_len(first) + len(answer.encode())

    # edited earlier message: common prefix ends inside the first user message
    edited = [SYSTEM, *turn("hello there", "x"), *turn("more")]
    # the system message rendering (prompt_len counts the trailing <|assistant|> token, which
    # stands in for the <|user|> token here), then "hello "
    common = prompt_len([SYSTEM]) + len("hello ")
    _, cached = ask(server, edited)
    assert cached == (common if rewindable else 0)

    # a repeated prompt: the whole prompt is cached; a rewindable engine keeps all but one token
    ask(server, first)
    _, cached = ask(server, first)
    assert cached == (prompt_len(first) - 1 if rewindable else 0)

    # an answer cut by a stop sequence: the token that completed the stop is not held, and the
    # dropped text is never reported as reused
    cut_answer, _ = ask(server, first, stop=[" wor"])
    assert cut_answer == "hello"
    follow = first + [{"role": "assistant", "content": cut_answer}, *turn("go on")]
    _, cached = ask(server, follow)
    # held: prompt + "hello wo" (the 'r' that completed " wor" was not fed back)
    assert cached == (prompt_len(first) + len("hello") if rewindable else 0)
    assert held > 0
    assert "cache miss" in server.log()


def test_rewind_then_generate_is_exact(start_server):
    warm, cold = start_server(), start_server("--no-reuse")
    long_history = [SYSTEM, *turn("first question", "first answer"), *turn("second")]
    fork = [SYSTEM, *turn("first question", "first answer"), *turn("another branch entirely")]
    for server in (warm, cold):
        ask(server, long_history)
    warm_answer, warm_cached = ask(warm, fork)
    cold_answer, cold_cached = ask(cold, fork)
    assert warm_answer == cold_answer == "another branch entirely"
    assert warm_cached > 0 and cold_cached == 0
