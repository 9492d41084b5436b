"""Fork by copy under ``--parallel 4`` on the echo engine, in process: a request sharing a long
prefix with an idle slot's conversation A, but less than half of it (an edited earlier answer; a
new conversation with A's system prompt), goes to an empty slot that starts from a copy of A's
usable prefix: its cached tokens are that prefix (as with ``--parallel 1``), A stays resident
and its next turn reuses all of it, and every answer is a cold server's. The source slot takes no job while its prefix is copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import pytest

from echo_app import echo_state
from inprocess import async_client
from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GeneratorSettings
from redlite.core.live_state import copy_prefix
from redlite.core.reuse import common_prefix_length
from redlite.core.worker import EngineWorker, Job
from redlite.engine.base import SamplingParams
from redlite.engine.echo import EchoEngine
from redlite.server.app import ServerState, create_app

pytestmark = pytest.mark.timeout(60)

tok = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in full. " * 4}
FIRST = {"role": "user", "content": "first question about apples and pears"}


def turns(a1: str = "", a2: str = "") -> dict[str, list[dict]]:
    """The requests, in order: A's two turns, B (A's first answer edited), C (a new
    conversation with A's system prompt), A's third turn."""
    a_two = [SYSTEM, FIRST, {"role": "assistant", "content": a1},
             {"role": "user", "content": "second turn " + "with a long body " * 20}]
    return {"a1": [SYSTEM, FIRST], "a2": a_two,
            "b": [SYSTEM, FIRST, {"role": "assistant", "content": a1[:10] + " (edited)"},
                  {"role": "user", "content": "so what then? " * 10}],
            "c": [SYSTEM, {"role": "user", "content": "unrelated: name a river"}],
            "a3": a_two + [{"role": "assistant", "content": a2}, {"role": "user", "content": "third"}]}


async def ask(client, messages) -> tuple[str, int]:
    r = await client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


async def sequence(app) -> dict[str, tuple[str, int]]:
    out = {}
    async with async_client(app) as client:
        for name in ("a1", "a2", "b", "c", "a3"):
            out[name] = await ask(client, turns(out.get("a1", ("",))[0], out.get("a2", ("",))[0])[name])
    return out


@contextlib.contextmanager
def app_of(parallel: int, can_rewind: bool, reuse: bool = True):
    if reuse:
        state = echo_state(parallel=parallel, engine=EchoEngine(can_rewind=can_rewind))
    else:
        worker = EngineWorker(Generator(EchoEngine(can_rewind=can_rewind), tok, GeneratorSettings(reuse=False)))
        state = ServerState(worker, tok, "echo", 1 << 20)
    try:
        yield create_app(state), state
    finally:
        state.worker.shutdown(wait_s=2.0)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 50))


@pytest.mark.parametrize("can_rewind", [True, False])
def test_an_empty_slot_starts_from_a_copy_of_the_shared_prefix(can_rewind, caplog):
    caplog.set_level(logging.INFO, logger="redlite.parking")
    with app_of(4, can_rewind) as (app, state):
        got = run(sequence(app))
        held = sorted(len(g.held_ids) for g in state.worker.generators)
    with app_of(1, can_rewind) as (app, _):
        alone = run(sequence(app))
    with app_of(1, can_rewind, reuse=False) as (app, _):
        cold = run(sequence(app))
    a1, a2 = got["a1"][0], got["a2"][0]
    requests = turns(a1, a2)
    a_held = tok.render_chat(requests["a2"]).token_ids + list(a2.encode())
    if can_rewind:  # the whole common prefix
        want_b = common_prefix_length(a_held, tok.render_chat(requests["b"]).token_ids)
        want_c = common_prefix_length(a_held, tok.render_chat(requests["c"]).token_ids)
    else:  # up to A's checkpoint: its first prompt's end; its system message's end
        want_b = len(tok.render_chat(requests["a1"]).token_ids)
        want_c = tok.render_chat(requests["c"]).message_ends[0]
    assert want_c > 150 and want_b > want_c and want_b < len(a_held) / 2
    assert (got["b"][1], got["c"][1]) == (want_b, want_c)
    assert (alone["b"][1], alone["c"][1]) == (want_b, want_c)  # as with one slot
    assert got["a3"][1] == len(a_held)  # A stayed resident and whole
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in cold.items()}
    assert len([r for r in caplog.records if " copied " in r.getMessage()]) == 2
    assert held.count(0) == 1  # A, B and C each in a slot of their own


def test_the_source_slot_takes_no_job_until_the_copy_is_done(monkeypatch):
    """Two slots: A's conversation in one; B (A's system prompt) goes to the other, copying
    from A; an unrelated job X, whose only idle slot is A's, waits until B's copy is done."""
    import redlite.core.conversations as conversations

    state = echo_state(parallel=2)
    worker = state.worker
    gate, copying, seen = threading.Event(), threading.Event(), {"b": [], "x": []}

    def held_copy(*args, **kwargs):  # B's copy from A's slot, held until the gate opens
        copying.set()
        gate.wait(20)
        return copy_prefix(*args, **kwargs)
    monkeypatch.setattr(conversations, "copy_prefix", held_copy)

    def job(name, messages):
        def deliver(event):
            seen[name].append(event)
        rendered = tok.render_chat(messages)
        request = GenerationRequest(rendered.token_ids, sampling=SamplingParams(temperature=0),
                                    message_ends=rendered.message_ends, request_id=name)
        return Job(request, deliver)

    try:
        a = job("a", [SYSTEM, {"role": "user", "content": "a long first message " * 20}])
        seen["a"] = []
        worker.submit(a)
        assert a.finished.wait(20)
        a_held = next(list(g.held_ids) for g in worker.generators if g.held_ids)
        b = job("b", [SYSTEM, {"role": "user", "content": "name a river"}])
        x = job("x", [{"role": "user", "content": "nothing shared"}])
        worker.submit(b)
        worker.submit(x)
        assert copying.wait(20)
        time.sleep(0.3)
        assert not seen["x"]  # X waits for A's slot: its prefix is lent to B
        gate.set()
        assert b.finished.wait(20) and x.finished.wait(20)
    finally:
        gate.set()
        worker.shutdown(wait_s=2.0)
    done = {name: next(e.value for e in events if e.kind == "done") for name, events in seen.items()}
    assert done["b"].cached_tokens == common_prefix_length(a_held, b.request.prompt_ids) > 150
    assert done["x"].cached_tokens == 0
    assert "".join(e.value.value for e in seen["x"] if e.kind == "output") == "nothing shared"
