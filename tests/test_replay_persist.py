"""Exact replay survives eviction and restarts: the turns a conversation holds are saved with
it (RAM entry, session file header) and a restarted server seeds its store from the files, so
the next turn in the client's re-serialized form is still a plain extension. The session key
is saved too: the session's file is its first candidate after a restart."""

from __future__ import annotations

import json

import httpx
import pytest

from inprocess import echo_call
from redlite.core.replay import GeneratedTurn, ReplayStore
from redlite.core.session_file import read_meta

WRITE = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}
SYSTEM = {"role": "system", "content": "You edit files."}
FIRST = [SYSTEM, {"role": "user", "content": echo_call(
    "write", {"path": "src/a.py", "content": "print('hi')\n" * 40})}]
OTHER = [SYSTEM, {"role": "user", "content": "An unrelated conversation that takes the engine."}]


def turn(position, answer, prefix=(7, 8)):
    return GeneratedTurn(list(prefix), "<a>", list(answer), f"text {answer}", "why",
                         (("call_1", "f", '{"a":1}'),), "ctx", position)


def test_record_round_trip_and_turns_found_by_position():
    kept = turn(3, [5, 6])
    assert GeneratedTurn.from_record(json.loads(json.dumps(kept.to_record()))) == kept
    store = ReplayStore()
    other = turn(1, [9, 9], prefix=(4,))
    store.record(kept)
    store.record(other)
    assert store.turns_in([0, 1, 2, 7, 8, 5, 6, 1]) == [kept]
    assert store.turns_in([0, 1, 2, 7, 8, 5]) == []  # its answer is cut: not held
    assert store.turns_in([0, 4, 9, 9, 7, 8, 5, 6]) == [other]  # kept: elsewhere
    # within a byte budget the latest turns stay
    assert store.turns_in([0, 4, 9, 9, 7, 8, 5, 6], budget_bytes=0) == []
    fresh = ReplayStore()
    assert fresh.restore([kept, other]) == 2 and fresh.restore([kept]) == 0


def ask(server, messages, session):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, headers={"session_id": session},
                   json={"messages": messages, "tools": [WRITE]})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"], body["usage"]


def sorted_keys(message):
    out = dict(message)
    out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
        json.loads(c["function"]["arguments"]), sort_keys=True, separators=(",", ":"))}}
        for c in message["tool_calls"]]
    return out


def restart_session(start_server, directory, *mode):
    """Turn 1 on one server (parked behind another conversation, both saved at stop), turn 2
    with sorted-keys arguments on a new server over the same directory: (held after turn 1,
    turn-2 usage, the second server, the first server)."""
    args = ("--session-dir", str(directory), "--session-min-tokens", "1", *mode)
    first = start_server(*args)
    answer, usage1 = ask(first, FIRST, "main-1")
    ask(first, OTHER, "other-2")  # the main conversation is parked in RAM
    assert first.stop() == 0
    held = usage1["prompt_tokens"] + usage1["completion_tokens"]
    second_turn = FIRST + [sorted_keys(answer), {"role": "tool", "content": "written",
                                                 "tool_call_id": answer["tool_calls"][0]["id"]}]
    second = start_server(*args)
    _, usage2 = ask(second, second_turn, "main-1")
    return held, usage2, second, first


@pytest.mark.parametrize("how", ["saved-at-stop", "spilled-from-ram"])
def test_restart_keeps_exact_replay_and_the_session(start_server, tmp_path, how):
    # spilled: a RAM pool too small for any conversation, so parking writes the file at once
    spill = ("--park-mib", "0.001") if how == "spilled-from-ram" else ()
    held, usage, server, first = restart_session(start_server, tmp_path / "exact", *spill)
    # a plain extension: every held token kept, the generated turn not prefilled again
    assert usage["prompt_tokens_details"]["cached_tokens"] == held
    log = server.log()
    assert "replay: 2 turns of saved conversations kept (2 in files)" in log, log
    assert "replay: 1 generated turn spliced session=main-1" in log
    assert "restored from disk" in log and "session=main-1" in log
    if spill:
        assert "reason=no-room -> disk" in first.log()
    metas = [read_meta(p)[0] for p in (tmp_path / "exact").glob("*.rlsession")]
    assert {m["session"] for m in metas} >= {"main-1", "other-2"}
    assert all(m["version"] == 2 for m in metas)
    main = next(m for m in metas if m["session"] == "main-1")
    assert main["replay"] and main["replay"][0]["calls"][0][1] == "write"
    # without exact replay the re-serialized arguments are a miss (the test can fail)
    held_t, usage_t, _, _ = restart_session(start_server, tmp_path / "template", *spill, "--replay", "template")
    assert usage_t["prompt_tokens_details"]["cached_tokens"] < held_t
