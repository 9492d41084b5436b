"""``--parallel`` with a server process: every slot's resident conversation is saved at stop
and restored after a restart (echo engine)."""

import re

import httpx

from test_sessions_echo import A, B, C, again, ask, held


def test_stop_saves_every_slot_and_restart_restores_them(start_server, tmp_path):
    args = ("--parallel", "3", "--session-dir", str(tmp_path), "--session-min-tokens", "1")
    first = start_server(*args)
    answers = [ask(first, conversation)[0] for conversation in (A, B, C)]
    slots = httpx.get(first.url + "/slots").json()
    assert sorted(s["n_past"] > 0 for s in slots) == [True] * 3  # each resident in a slot
    assert first.stop() == 0
    assert len(re.findall(r"saved \d+ tok", first.log())) == 3
    second = start_server(*args)
    assert "3 saved conversations indexed" in second.log()
    for conversation, answer in zip((A, B, C), answers):
        _, cached = ask(second, again(conversation, answer))
        assert cached == held(conversation, answer)
