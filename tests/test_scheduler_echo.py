"""Several conversations at once (``--parallel``, core/scheduler.py) on the echo engine, in
process: each conversation's text equals the same conversation served alone, streaming and
stop sequences exact, cancellation and shutdown per sequence, the queue limit, placement, and
a main agent that never re-prefills its history while a sub-agent runs beside it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest

from echo_app import echo_state
from inprocess import async_client
from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.core.placement import SlotView, choose_slot
from redlite.core.worker import CUT_OFF, Job, QueueFull, ShuttingDown
from redlite.engine.base import SamplingParams
from redlite.engine.echo import EchoEngine
from redlite.server.app import create_app

tok = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are terse."}


@contextlib.contextmanager
def echo_app(parallel: int, delay_ms: float = 0.0, can_rewind: bool = True, **kwargs):
    state = echo_state(parallel=parallel, engine=EchoEngine(delay_ms=delay_ms, can_rewind=can_rewind),
                       **kwargs)
    try:
        yield create_app(state), state
    finally:
        state.worker.shutdown(wait_s=2.0)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def chat(client, messages, stream=False, **fields) -> tuple[str, str, int]:
    """(content, finish_reason, cached_tokens) of one greedy chat completion."""
    body = {"messages": messages, "temperature": 0, "stream": stream, **fields}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        data = r.json()
        choice = data["choices"][0]
        return (choice["message"]["content"], choice["finish_reason"],
                data["usage"]["prompt_tokens_details"]["cached_tokens"])
    content, finish, cached = "", None, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            content += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return content, finish, cached


async def conversation(client, name: str, turns: int, stream: bool, stop=None) -> list[tuple]:
    """``turns`` turns of one conversation; each answer goes back into the history."""
    messages, out = [SYSTEM], []
    for t in range(turns):
        messages.append({"role": "user", "content": f"{name} says turn {t}: " + "word " * (3 + t)})
        fields = {"stop": stop} if stop else {}
        content, finish, cached = await chat(client, messages, stream, **fields)
        out.append((content, finish, cached))
        messages.append({"role": "assistant", "content": content})
    return out


NAMES = ["alpha", "bravo", "charlie", "delta"]


@pytest.mark.parametrize("can_rewind,decode_ahead", [(True, False), (False, False), (True, True)])
def test_four_conversations_at_once_match_each_served_alone(can_rewind, decode_ahead):
    """(can_rewind False: a hybrid's checkpoints; decode_ahead: the executor token streams)"""
    async def together(app):
        async with async_client(app) as client:
            return await asyncio.gather(*(conversation(client, n, 3, i % 2 == 1, ["turn 2"] if i == 3 else None)
                                          for i, n in enumerate(NAMES)))

    async def alone(app):
        async with async_client(app) as client:
            return [await conversation(client, n, 3, i % 2 == 1, ["turn 2"] if i == 3 else None)
                    for i, n in enumerate(NAMES)]

    with echo_app(4, delay_ms=1.0, can_rewind=can_rewind, decode_ahead=decode_ahead) as (app, state):
        got = run(together(app))
        executor = state.worker.executor
        assert executor.batched_tokens > executor.batches  # decode steps were batched
        held = [g.held_ids for g in state.worker.generators]
        assert all(g.held_ids == g.engine.target.held_ids for g in state.worker.generators)
    with echo_app(1, can_rewind=can_rewind) as (app, _):
        expected = run(alone(app))
    # the same text, and later turns reuse as much (a first turn alone may reuse the system
    # prompt the conversation before it left)
    assert [[t[:2] for t in c] for c in got] == [[t[:2] for t in c] for c in expected]
    assert [[t[2] for t in c[1:]] for c in got] == [[t[2] for t in c[1:]] for c in expected]
    assert got[3][2][:2] == ("delta says ", "stop")  # the stop sequence cut exactly
    assert all(turn[2] > 0 for conversation in got for turn in conversation[1:])  # reused
    assert sum(1 for h in held if h) == 4  # every conversation stayed resident in its slot


def request(text: str, **fields) -> GenerationRequest:
    prompt = tok.render_chat([SYSTEM, {"role": "user", "content": text}]).token_ids
    return GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0),
                             request_id=text[:8], **fields)


def job(text: str, **fields) -> tuple[Job, list]:
    events: list = []
    return Job(request(text, **fields), events.append), events


def text_of(events) -> str:
    return "".join(e.value.value for e in events if e.kind == "output")


def result_of(events) -> GenerationResult:
    return next(e.value for e in events if e.kind == "done")


def test_cancelling_one_leaves_the_others_and_its_own_slot_consistent():
    state = echo_state(parallel=3, engine=EchoEngine(delay_ms=2.0))
    worker = state.worker
    try:
        texts = ["first " * 20, "second " * 20, "third " * 20]
        jobs = [job(t) for t in texts]
        for j, _ in jobs:
            worker.submit(j)
        victim, victim_events = jobs[1]
        while sum(e.kind == "output" for e in victim_events) < 5:
            victim.finished.wait(0.01)
        victim.cancel()
        for j, _ in jobs:
            assert j.finished.wait(30)
        assert result_of(victim_events).finish_reason == "cancelled"
        for (j, events), text in zip(jobs, texts):
            if j is not victim:
                assert text_of(events) == text and result_of(events).finish_reason == "stop"
        for g in worker.generators:
            assert not g.failed and g.held_ids == g.engine.target.held_ids
        again, events = job(texts[1])  # the cancelled conversation, asked again
        worker.submit(again)
        assert again.finished.wait(30)
        assert text_of(events) == texts[1]
    finally:
        worker.shutdown(wait_s=2.0)


def test_shutdown_stops_every_running_sequence_and_fails_the_waiting():
    state = echo_state(parallel=2, engine=EchoEngine(delay_ms=5.0))
    worker = state.worker
    jobs = [job(f"talk {i} " * 100) for i in range(3)]
    for j, _ in jobs:
        worker.submit(j)
    while not all(any(e.kind == "output" for e in events) for _, events in jobs[:2]):
        threading.Event().wait(0.01)
    worker.shutdown(wait_s=10.0)
    assert not worker.alive
    for j, events in jobs[:2]:
        errors = [e.value for e in events if e.kind == "error"]
        assert isinstance(errors[0], ShuttingDown) and str(errors[0]) == CUT_OFF
    assert [type(e.value) for e in jobs[2][1]] == [ShuttingDown]
    for g in worker.generators:
        assert not g.failed and g.held_ids == g.engine.target.held_ids
    with pytest.raises(ShuttingDown):
        worker.submit(job("late")[0])


def test_the_queue_holds_max_queue_behind_the_running_slots():
    state = echo_state(parallel=2, engine=EchoEngine(delay_ms=5.0), max_queue=1)
    worker = state.worker
    try:
        jobs = [job(f"long {i} " * 50) for i in range(3)]
        for j, _ in jobs:
            worker.submit(j)
        with pytest.raises(QueueFull):
            worker.submit(job("one too many")[0])
        for j, _ in jobs:
            j.cancel()
    finally:
        worker.shutdown(wait_s=5.0)


def test_a_full_queue_answers_503_over_http():
    async def flood(app):
        async with async_client(app) as client:
            body = {"messages": [{"role": "user", "content": "x " * 200}], "max_tokens": 300}
            replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body)
                                             for _ in range(5)))
            return sorted(r.status_code for r in replies)

    with echo_app(2, delay_ms=2.0, max_queue=1) as (app, _):
        assert run(flood(app)) == [200, 200, 200, 503, 503]


def test_main_agent_never_reprefills_its_history_beside_a_sub_agent():
    """20 turns of a main agent, each sent while a sub-agent (same system prompt, its own
    conversation) streams: main's cached tokens are its whole previous prompt and answer."""

    async def session(app):
        async with async_client(app) as client:
            main, sub, cached, held = [SYSTEM], [SYSTEM], [], 0
            for t in range(20):
                main.append({"role": "user", "content": f"main step {t} " + "go " * 4})
                sub.append({"role": "user", "content": f"sub task {t} " + "look " * 6})
                (answer, _, hit), (sub_answer, _, _) = await asyncio.gather(
                    chat(client, main), chat(client, sub, stream=True))
                cached.append((hit, held))
                held = len(tok.render_chat(main).token_ids) + len(answer.encode())
                main.append({"role": "assistant", "content": answer})
                sub.append({"role": "assistant", "content": sub_answer})
            return cached

    with echo_app(2, delay_ms=0.5) as (app, state):
        cached = run(session(app))
    # turn t > 0: everything held after turn t - 1 (its prompt and its answer) is reused
    assert all(hit == held for hit, held in cached), cached
    assert cached[19][0] > 400


def test_placement_keeps_residents_and_prefers_forks_of_them():
    prompt = [1, 2, 3, 4, 5, 6]
    main = SlotView(0, [1, 2, 3, 4], True, True, last_used=5.0)      # the prompt extends it
    empty = SlotView(1, [], True, True, last_used=1.0)
    other = SlotView(2, [1, 9, 9, 9, 9, 9], True, True, last_used=0.0)  # shares one token
    assert choose_slot([empty, other, main], prompt) == 0
    assert choose_slot([empty, other], prompt) == 1  # a small shared prefix: not worth a park
    fork = SlotView(3, [1, 2, 3, 4, 5, 7, 7], True, True, last_used=9.0)  # a regenerate
    assert choose_slot([empty, fork], prompt) == 3
    untrusted = SlotView(4, [1, 2, 3, 4], False, True, last_used=2.0)
    assert choose_slot([untrusted, empty], prompt) == 1  # ties: the least recently used
    assert choose_slot([SlotView(5, [7], True, True, last_used=3.0),
                        SlotView(6, [8], True, True, last_used=2.0)], prompt) == 6
    with pytest.raises(ValueError):
        choose_slot([], prompt)


def test_a_long_prefill_holds_the_others_back_by_one_chunk_at_most():
    """A 2,000-token prompt (echo prefill: 0.5 ms per token, 1 s in all) arrives while another
    conversation streams; with 50-token chunks its tokens keep coming (gaps ~ one chunk)."""
    engine = EchoEngine(delay_ms=1.0, prefill_delay_ms=0.5)
    state = echo_state(parallel=2, engine=engine, prefill_chunk=50)
    worker = state.worker
    stamps: list[float] = []
    try:
        streaming, events = job("stream " * 150)
        original = streaming.deliver
        streaming.deliver = lambda e: (stamps.append(time.monotonic()), original(e))
        worker.submit(streaming)
        while len(stamps) < 20:
            streaming.finished.wait(0.01)
        long_job, long_events = job("long " * 400)
        begun = time.monotonic()
        worker.submit(long_job)
        assert long_job.finished.wait(30) and streaming.finished.wait(30)
        prefill_s = result_of(long_events).ttft_ms / 1000.0
    finally:
        worker.shutdown(wait_s=2.0)
    assert prefill_s > 0.9  # the long prefill really took its second
    during = [b - a for a, b in zip(stamps, stamps[1:]) if begun <= a <= begun + prefill_s]
    assert len(during) > 10 and max(during) < 0.2, max(during)


def test_slots_and_conversations_show_every_slot(tmp_path):
    async def probe(app, state):
        async with async_client(app) as client:
            await asyncio.gather(*(chat(client, [{"role": "user", "content": f"hello {i}"}])
                                   for i in range(3)))
            slots = (await client.get("/slots")).json()
            live = [c for c in (await client.get("/v1/conversations")).json()["data"]
                    if c["tier"] == "live"]
            saved = await client.post("/slots/2?action=save", json={"filename": "two.bin"})
            bad = await client.post("/slots/3?action=save", json={"filename": "x.bin"})
            return slots, live, saved, bad

    with echo_app(3, slot_dir=tmp_path) as (app, state):
        slots, live, saved, bad = run(probe(app, state))
    assert [s["id"] for s in slots] == [0, 1, 2]
    assert sorted(s["n_past"] > 0 for s in slots) == [True] * 3
    assert sorted(c["slot"] for c in live) == [0, 1, 2]
    assert sorted(c["id"] for c in live) == ["live", "live-1", "live-2"]
    assert all(isinstance(c["last_used"], float) and c["last_used"] > 1e9 for c in live)
    assert saved.status_code == 200 and saved.json()["id_slot"] == 2
    assert saved.json()["n_saved"] == slots[2]["n_past"]
    assert bad.status_code == 400
