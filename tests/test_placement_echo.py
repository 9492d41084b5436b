"""Placement under ``--parallel`` on the echo engine, in process: two conversations taking turns
each stay resident in their own slot, with no parking, restore or re-prefill after the first
turn of each, whether they share a long system prompt or the slots held other conversations."""

from __future__ import annotations

import asyncio
import logging

import pytest

from echo_app import echo_state
from inprocess import async_client
from redlite.engine.echo import EchoEngine
from redlite.server.app import create_app

pytestmark = pytest.mark.timeout(60)


async def turn(client, messages: list[dict]) -> dict:
    r = await client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return body


async def alternate(app, system: str, turns: int, before: int) -> list[tuple[str, dict]]:
    """``before`` unrelated conversations first (they fill the slots), then A and B taking
    ``turns`` turns each, one after the other; (name, response body) of A's and B's turns."""
    out = []
    async with async_client(app) as client:
        for i in range(before):
            await turn(client, [{"role": "user", "content": f"an earlier conversation {i} " * 4}])
        history = {name: [{"role": "system", "content": system}] for name in "AB"}
        for t in range(turns):
            for name in "AB":
                history[name].append({"role": "user", "content": f"{name} turn {t}: " + "word " * 5})
                out.append((name, await turn(client, history[name])))
    return out


@pytest.mark.parametrize("parallel,system,before,can_rewind", [
    (2, "You share a long system prompt and tools. " * 20, 0, True),   # > half of each resident
    (2, "You share a long system prompt and tools. " * 20, 0, False),  # checkpoints, no rewind
    (3, "You share a long system prompt and tools. " * 20, 0, True),
    (2, "You are terse.", 2, True),  # both slots hold older conversations
    (4, "You are terse.", 4, True),
    (2, "You share a long system prompt and tools. " * 20, 2, False),
])
def test_two_conversations_taking_turns_stay_in_their_own_slots(parallel, system, before, can_rewind,
                                                                 caplog):
    state = echo_state(parallel=parallel, engine=EchoEngine(can_rewind=can_rewind))
    try:
        with caplog.at_level(logging.INFO, logger="redlite"):
            replies = asyncio.run(asyncio.wait_for(alternate(create_app(state), system, 4, before), 50))
    finally:
        state.worker.shutdown(wait_s=2.0)
    later = {body["id"] for _, body in replies[2:]}  # every turn after the first of each
    lines = [r.getMessage() for r in caplog.records]
    placed = {line.split()[0]: int(line.split("placed in slot ")[1].split(":")[0])
              for line in lines if "placed in slot" in line}
    slot = {name: placed[body["id"]] for name, body in replies[:2]}
    assert slot["A"] != slot["B"]
    assert [placed[body["id"]] for _, body in replies] == [slot[name] for name, _ in replies]
    moves = [line for line in lines if any(w in line for w in ("parked ", "restored from", "copied "))]
    assert not [line for line in moves if line.split()[0] in later], moves
    # parked: only the earlier conversations that A's and B's first turns replace
    assert len([line for line in moves if " parked " in line]) == (2 if before else 0), moves
    # each later turn prefills only its new message: the previous turn's prompt and answer are kept
    previous = {}
    for name, body in replies:
        usage = body["usage"]
        if name in previous:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= previous[name], (name, usage)
        previous[name] = usage["prompt_tokens"] + usage["completion_tokens"] - 1


@pytest.mark.timeout(60)
def test_a_parking_line_starts_with_its_requests_id(caplog):
    """The regenerate that parks the old answer names itself first on its 'parked' line, as on
    its other lines (the id is the response's)."""
    from echo_app import echo_client

    body = {"messages": [{"role": "user", "content": "tell me a story " * 20}], "max_tokens": 6}
    with caplog.at_level(logging.INFO), echo_client() as client:
        first = client.post("/v1/chat/completions", json=body)
        again = client.post("/v1/chat/completions", json=body)
    assert first.status_code == again.status_code == 200
    parked = [r.getMessage() for r in caplog.records if " parked " in r.getMessage()]
    assert parked and all(line.split()[0] == again.json()["id"] for line in parked), parked
