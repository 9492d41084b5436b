"""The cache-miss log line after another conversation was brought back: its divergence note
must describe the restored conversation, not the slot's previous one (whose answer start is
stale once the held ids are replaced)."""

from __future__ import annotations

import pytest

from echo_app import echo_client
from redlite.core.checkpoints import CheckpointStore
from redlite.core.sequence import Sequence

pytestmark = pytest.mark.timeout(60)

SYSTEM = "You are a careful librarian who answers in full sentences. " * 3


def test_replacing_held_ids_forgets_the_answer_start():
    seq = Sequence(engine=None, checkpoints=CheckpointStore(0))
    seq.held_ids = [1, 2, 3]
    seq.answer_start = 2
    seq.held_ids.append(4)  # the same conversation growing keeps it
    assert seq.answer_start == 2
    seq.held_ids = [7, 8]  # another conversation installed
    assert seq.answer_start is None


def test_miss_after_a_restore_names_the_message_not_a_stale_answer(caplog):
    def ask(client, system, question):
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "max_tokens": 24, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with echo_client() as client:
        ask(client, SYSTEM, "Recommend a mystery novel.")
        ask(client, "Be terse.", "Hi")  # parks the first conversation
        with caplog.at_level("INFO", logger="redlite.generation"):
            usage = ask(client, SYSTEM, "Recommend a science fiction novel.")
    assert usage["prompt_tokens_details"]["cached_tokens"] > len(SYSTEM)
    line = next(m for m in caplog.messages if "cache miss" in m)
    assert "inside the previous answer" not in line and "a message differs from the held conversation's" in line
