"""Checkpoints for engines that cannot rewind: the store's rules (unit) and restore through a
real server with the echo engine in its non-rewindable mode."""

import httpx
import random

import pytest

from echo_app import echo_client
from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.checkpoints import CheckpointStore, preamble_end, prefill_split_points
from redlite.engine.base import Checkpoint
from redlite.engine.echo import EchoEngine

tok = ByteTokenizer()


def cp(position, nbytes=100, turn=False):
    return Checkpoint(position, logits=None, data=None, nbytes=nbytes, turn_boundary=turn)


def test_split_points():
    assert prefill_split_points(0, 10, [], 0) == [10]
    assert prefill_split_points(0, 3000, [5, 2999, 3000, 4000], 1024) == [5, 1024, 2048, 2999, 3000]
    assert prefill_split_points(1500, 2100, [1400, 1600], 1024) == [1600, 2048, 2100]


def test_store_keeps_turn_boundaries_and_newest_and_thins_evenly():
    store = CheckpointStore(budget_bytes=1000)
    store.add(cp(100, turn=True))
    for position in range(200, 1300, 100):
        store.add(cp(position))
    assert store.nbytes <= 1000
    positions = store.positions
    assert positions[0] == 100 and positions[-1] == 1200
    gaps = [b - a for a, b in zip(positions, positions[1:])]
    assert max(gaps) <= 2 * min(gaps)  # evenly thinned, no large hole
    store.drop_after(700)
    assert store.positions[-1] <= 700
    store.add(cp(700))
    assert store.get(700) is not None and store.positions.count(700) == 1


def test_store_over_budget_with_only_turn_boundaries_drops_oldest():
    store = CheckpointStore(budget_bytes=250)
    for position in (10, 20, 30):
        store.add(cp(position, turn=True))
    assert store.positions == [20, 30]


def test_pinned_preamble_is_thinned_last():
    store = CheckpointStore(budget_bytes=350)
    store.add(cp(10), pinned=True)
    for position in (20, 30, 40, 50):
        store.add(cp(position, turn=position % 20 == 0))
    assert store.positions == [10, 40, 50]  # interior first, then the oldest turn boundary
    store.add(cp(60, turn=True))
    assert store.positions == [10, 40, 60]
    store.budget_bytes = 150
    store.add(cp(70))
    assert store.positions == [70]  # the pinned one goes last, the newest stays
    store.budget_bytes = 250
    store.add(cp(80), pinned=True)
    store.drop_after(75)  # the pinned one is cut: no pin
    store.pin(70)  # a kept checkpoint pinned again (a restored conversation)
    store.add(cp(90, turn=True))
    store.add(cp(100, turn=True))
    assert store.positions == [70, 100]
    assert preamble_end([5, 9, 12], ["system", "developer", "user"]) == 9
    assert preamble_end([5, 9], ["user", "assistant"]) is None
    assert preamble_end([5], ["system", "user"]) is None  # not aligned


def ask(server, messages):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_forks_restore_from_checkpoints_and_match_a_cold_server(start_server):
    warm = start_server("--echo-no-rewind", "--checkpoint-min-piece", "0")  # a cut at every boundary
    cold = start_server("--echo-no-rewind", "--no-reuse")
    system = {"role": "system", "content": "be brief"}
    turn1 = [system, {"role": "user", "content": "first question"}]
    answer1, _ = ask(warm, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "second one"}]
    answer2, cached = ask(warm, turn2)
    assert cached == len(tok.render_chat(turn1).token_ids) + len(answer1)  # a plain extension

    # edited last user message: restore the checkpoint at the end of the assistant message
    edited = turn1 + [{"role": "assistant", "content": answer1}, {"role": "user", "content": "second TWO"}]
    boundary = tok.render_chat(turn1 + [{"role": "assistant", "content": answer1}]).message_ends[-1]
    answer, cached = ask(warm, edited)
    assert (answer, cached) == (ask(cold, edited)[0], boundary)

    # regenerated answer: the whole prompt is cached and ends at a checkpoint: zero prefill
    answer, cached = ask(warm, edited)
    assert (answer, cached) == ("second TWO", len(tok.render_chat(edited).token_ids))
    last_prefill = [line for line in warm.log().splitlines() if " prefill " in line][-1]
    assert " prefill 0 tok " in last_prefill, last_prefill

    # answer trimmed by the client: restore the turn boundary before the answer
    trimmed = edited + [{"role": "assistant", "content": "second"}, {"role": "user", "content": "go on"}]
    answer, cached = ask(warm, trimmed)
    assert (answer, cached) == (ask(cold, trimmed)[0], len(tok.render_chat(edited).token_ids))
    assert "restore from checkpoint at" in warm.log()
    assert "checkpoints: " in warm.log()


def test_split_points_keep_pieces_of_at_least_min_piece():
    # a second turn: 2 tokens of the old answer's end, an 11-token user message, a 3-token header
    assert prefill_split_points(100, 116, [102, 113], 1024, min_piece=32) == [116]
    assert prefill_split_points(100, 116, [102, 113], 1024, min_piece=0) == [102, 113, 116]
    # long prompts keep their boundaries and interval cuts, less those too close to a neighbour
    assert prefill_split_points(0, 3000, [5, 40, 2000, 2990, 3000], 1024, min_piece=32) == [40, 1024, 2000, 2048, 3000]


def test_split_points_leave_lazy_ends_unread_when_no_cut_could_stay():
    from redlite.core.tokenizer import LazyPositions

    reads = []
    ends = LazyPositions(lambda: reads.append(1) or [102, 113])
    assert prefill_split_points(100, 116, ends, 1024, min_piece=32) == [116]
    assert prefill_split_points(100, 116, ends, 1024, min_piece=32, preamble=105) == [105, 116]
    assert not ends.known and not reads
    # a prefill of twice min_piece may hold a cut: the ends are read then
    assert prefill_split_points(100, 164, ends, 0, min_piece=32) == [164]
    assert ends.known and len(reads) == 1
    assert prefill_split_points(100, 164, [132], 0, min_piece=32) == [132, 164]
    # whatever the ends and interval, a range under 2 * min_piece has no cut but the preamble
    rng = random.Random(5)
    for _ in range(300):
        start, piece = rng.randrange(0, 500), rng.randrange(1, 80)
        end = start + rng.randrange(1, 2 * piece)
        marks = sorted(rng.sample(range(0, 700), 6))
        preamble = rng.choice([None, *marks])
        expect = ([preamble] if preamble is not None and start < preamble < end else []) + [end]
        assert prefill_split_points(start, end, marks, rng.choice([0, 7, 64]), piece, preamble) == expect


def test_split_points_always_cut_the_preamble():
    # system + tools end at 300, a short first user message: the preamble is cut all the same
    assert prefill_split_points(0, 328, [300, 325], 0, min_piece=64, preamble=300) == [300, 328]
    # a cut closer than min_piece before the preamble goes, the preamble stays
    assert prefill_split_points(0, 600, [250, 300, 500], 0, min_piece=64, preamble=300) == [300, 500, 600]
    assert prefill_split_points(300, 328, [300, 325], 0, min_piece=64, preamble=300) == [328]


@pytest.mark.timeout(60)
def test_new_conversation_restores_the_preamble_with_a_min_piece():
    """--checkpoint-min-piece 64 (the GPU default) on a no-rewind engine: a second conversation
    with the same system prompt and a short first message restores the preamble checkpoint."""
    engine = EchoEngine(can_rewind=False)
    engine.checkpoint_min_piece = 64
    system = {"role": "system", "content": "S" * 300}
    with echo_client(engine=engine) as client:
        cached = []
        for task in ("first task", "second task"):
            r = client.post("/v1/chat/completions", json={
                "messages": [system, {"role": "user", "content": task}], "max_tokens": 4})
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        preamble = ByteTokenizer().render_chat([system, {"role": "user", "content": "x"}]).message_ends[0]
        assert cached == [0, preamble]


def test_batch_invariant_says_it_has_no_effect_off_cuda(start_server):
    server = start_server("--batch-invariant")
    assert "--batch-invariant: no effect on cpu" in server.log()
