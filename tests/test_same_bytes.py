"""Re-tokenized spans keep their held ids (:mod:`redlite.core.same_bytes` through
:func:`redlite.core.reuse.plan_reuse`): the planner on made-up vocabularies, then the echo
engine in process with merged tokens (the engine writes ``th`` as one token, the tokenizer
spells text byte by byte, as a sampled model writes a token its tokenizer would split), with
the replay store empty so only byte matching can keep the held answer. Each server case is
also run with byte matching off, where it misses (so the tests can fail)."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_app import echo_client
from inprocess import echo_call
from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GeneratorSettings
from redlite.core.reuse import Action, plan_reuse
from redlite.core.same_bytes import align_same_bytes
from redlite.engine.echo import EchoEngine
from redlite.server.chat_service import ChatOptions

MERGED = (b"th", b"ing", b"e ", b"\": \"")
AB, ABC, SPECIAL = 300, 301, 302


def vocab(token: int) -> bytes | None:
    if token < 256:
        return bytes([token])
    return {AB: b"ab", ABC: b"abc"}.get(token)  # SPECIAL: None


@pytest.mark.parametrize("can_rewind", [True, False])
def test_merged_held_token_spelled_in_bytes_is_an_extension(can_rewind):
    held = [1, 2, AB, 99, 5]                 # the answer held "ab" as one token
    prompt = [1, 2, 97, 98, 99, 5, 7]        # the client's copy spells it a, b
    plan = plan_reuse(held, prompt, can_rewind, token_bytes=vocab)
    assert plan.action is Action.EXTEND and plan.keep == 5 and plan.prefill == 1
    same = plan.same_bytes
    assert same.spans == ((2, 3, 2, 4),) and same.nbytes == 2
    assert same.prompt_ids(held, prompt) == [1, 2, AB, 99, 5, 7]
    assert [same.map_position(p) for p in range(8)] == [0, 1, 2, 2, 3, 4, 5, 6]
    # the other way round: held bytes, prompt merged
    plan = plan_reuse([1, 2, 97, 98, 99, 5], [1, 2, ABC, 5, 6], can_rewind, token_bytes=vocab)
    assert plan.action is Action.EXTEND and plan.keep == 6


def test_no_span_without_equal_bytes_or_across_a_special_token():
    assert align_same_bytes([1, AB, 5], [1, 97, 99, 5], 1, vocab) is None      # "ab" vs "ac"
    assert align_same_bytes([1, ABC, 5], [1, 97, 98, 5], 1, vocab) is None     # "abc" vs "ab"+5
    assert align_same_bytes([1, SPECIAL, 5], [1, 97, 5], 1, vocab) is None
    plan = plan_reuse([1, 2, SPECIAL, 5], [1, 2, 97, 5, 6], True, token_bytes=vocab)
    assert plan.action is Action.REWIND and plan.keep == 2 and plan.same_bytes is None


def test_walk_goes_through_several_spans_and_stops_at_the_first_other_byte():
    held = [7, AB, 8, 8, AB, 9, 10]
    prompt = [7, 97, 98, 8, 8, 97, 98, 9, 11, 12]
    same = align_same_bytes(held, prompt, 1, vocab)
    assert same.spans == ((1, 2, 1, 3), (4, 5, 5, 7))
    assert (same.held_end, same.prompt_end) == (6, 8)
    plan = plan_reuse(held, prompt, True, token_bytes=vocab)
    assert plan.action is Action.REWIND and plan.keep == 6  # then 10 vs 11 differ
    assert plan_reuse(held, prompt, True).keep == 1  # without byte matching


def spell(text: bytes, cuts: list[bool]) -> list[int]:
    """``text`` as ids where each "ab" / "abc" may be merged (``cuts[k]`` for the k-th one)."""
    ids, k, at = [], 0, 0
    while at < len(text):
        for piece, token in ((b"abc", ABC), (b"ab", AB)):
            if text.startswith(piece, at) and cuts[k % len(cuts)]:
                ids.append(token)
                at += len(piece)
                k += 1
                break
        else:
            ids.append(text[at])
            at += 1
            k += 1
    return ids


def spelled(ids: list[int]) -> bytes:
    return b"".join(vocab(t) for t in ids)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40).map(lambda b: bytes(97 + x % 4 for x in b)), st.binary(max_size=8),
       st.lists(st.booleans(), min_size=1, max_size=8), st.lists(st.booleans(), min_size=1, max_size=8),
       st.integers(0, 40), st.booleans())
def test_the_respelled_prompt_spells_the_same_bytes(text, tail, cuts_held, cuts_prompt, cut, can_rewind):
    """Whatever the two spellings: the plan's prompt spells the client's bytes, keeps at least
    as much as without byte matching, and its kept ids are held ids."""
    held = [1] + spell(text[:cut], cuts_held)
    prompt = [1] + spell(text, cuts_prompt) + list(tail)
    plan = plan_reuse(held, prompt, can_rewind, [1], token_bytes=vocab)
    plain = plan_reuse(held, prompt, can_rewind, [1])
    assert plan.keep >= plain.keep
    if plan.same_bytes is not None:
        new = plan.same_bytes.prompt_ids(held, prompt)
        assert spelled(new) == spelled(prompt) and len(new) == plan.prompt_len
        assert new[:plan.keep] == held[:plan.keep]


def ask(client, messages, **fields):
    r = client.post("/v1/chat/completions", json={"model": "echo", "messages": messages, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"], body["usage"]


def cold_answer(prompt_ids: list[int], can_rewind: bool) -> list[int]:
    """What a fresh generator answers for ``prompt_ids`` (token ids)."""
    generator = Generator(EchoEngine(can_rewind=can_rewind, merged=MERGED), ByteTokenizer(MERGED))
    items = list(generator.run(GenerationRequest(list(prompt_ids))))
    return items[-1].answer_ids


SYSTEM = {"role": "system", "content": "You answer."}
TEXT = "the thing is that nothing is there"
WRITE = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}


@pytest.mark.parametrize("can_rewind", [True, False])
@pytest.mark.parametrize("case", ["as-text", "tool-call"])
def test_answer_sent_back_as_text_keeps_the_held_ids(case, can_rewind, caplog):
    fields = {"tools": [WRITE]} if case == "tool-call" else {}
    user = echo_call("write", {"path": "the_thing.txt", "content": TEXT}) if case == "tool-call" else TEXT
    cached = {}
    for same_bytes in (True, False):
        with echo_client(merged=MERGED, same_bytes=same_bytes,
                         chat_options=ChatOptions(replay_bytes=0)) as client:  # no kept turns
            client.state.worker.generator.engine.can_rewind = can_rewind
            first = [SYSTEM, {"role": "user", "content": user}]
            answer, usage1 = ask(client, first, **fields)
            if case == "tool-call":
                assert answer["tool_calls"][0]["function"]["name"] == "write"
            else:
                assert answer["content"] == TEXT
            assert usage1["completion_tokens"] < len(user.encode())  # merged tokens were written
            back = {"role": "assistant", "content": answer.get("content") or ""}
            if answer.get("tool_calls"):  # sent back as the server gave them
                back["tool_calls"] = answer["tool_calls"]
            second = first + [back, {"role": "user", "content": "and then?"}]
            with caplog.at_level(logging.INFO, logger="redlite.generation"):
                caplog.clear()
                _, usage2 = ask(client, second, **fields)
            held = usage1["prompt_tokens"] + usage1["completion_tokens"]
            cached[same_bytes] = usage2["prompt_tokens_details"]["cached_tokens"]
            if same_bytes:
                assert cached[True] == held  # the whole held answer: a plain extension
                assert "same bytes, other ids" in caplog.text
                generator = client.state.worker.generator
                answer_ids = generator.engine.held_ids[usage2["prompt_tokens"]:]
                prompt = generator.engine.held_ids[:usage2["prompt_tokens"]]
                assert cold_answer(prompt, can_rewind)[:len(answer_ids)] == answer_ids
    assert cached[False] < cached[True]


def test_completion_prompt_holding_the_generated_text_extends():
    for same_bytes, expect_all in ((True, True), (False, False)):
        with echo_client(merged=MERGED, same_bytes=same_bytes) as client:
            first = client.post("/v1/completions", json={"model": "echo", "prompt": TEXT,
                                                          "max_tokens": 12}).json()
            text = first["choices"][0]["text"]
            assert text and first["usage"]["completion_tokens"] < len(text.encode())
            held = len(client.state.worker.generator.held_ids)  # the last token is not held
            assert held == first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
            second = client.post("/v1/completions", json={
                "model": "echo", "prompt": TEXT + text + " and more", "max_tokens": 4}).json()
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached == held) is expect_all, (cached, held)


def test_respelled_prompt_and_kept_turns_work_together():
    """Turn 1 is cut by a stop sequence (so not kept for exact replay): its text comes back
    re-tokenized and only byte matching keeps it. Turn 2's answer is kept with the respelled
    prompt's boundaries; turn 3 sends both back as text: turn 1 by bytes, turn 2 spliced from
    the kept turn, all held ids reused."""
    with echo_client(merged=MERGED) as client:
        generator = client.state.worker.generator
        first = [SYSTEM, {"role": "user", "content": TEXT}]
        answer, usage1 = ask(client, first, stop=["nothing"])
        assert answer["content"] == "the thing is that "
        history = first + [{"role": "assistant", "content": answer["content"]},
                           {"role": "user", "content": "the other thing"}]
        answer2, usage2 = ask(client, history)
        assert usage2["prompt_tokens_details"]["cached_tokens"] > usage1["prompt_tokens"] + 5
        assert client.state.chat.replay is not None and len(client.state.chat.replay) == 1
        held = len(generator.held_ids)
        history += [{"role": "assistant", "content": answer2["content"]},
                    {"role": "user", "content": json.dumps({"k": "the end"})}]
        _, usage3 = ask(client, history)
        assert usage3["prompt_tokens_details"]["cached_tokens"] == held
