"""Forks cost what they change (issue 16): a fork parks only the tail it discards; restoring
the old branch puts the tail back on the live prefix; the invariant of tail entries (their
prefix is the live state or another parked entry) holds through rewinds, resets, failures,
eviction and the disk tier. In-process, echo engine (rewindable and recurrent-like)."""

import logging
import re

import pytest

from redlite.core.byte_tokenizer import END, ByteTokenizer
from redlite.core.conversations import Conversations
from redlite.core.live_state import capture, install, reset
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult, GeneratorSettings
from redlite.core.eviction import EntryStats, plan_fit
from redlite.core.parking import LIVE, ParkingPool
from redlite.core.sessions import SessionStore, expected_for
from redlite.engine.base import SamplingParams
from redlite.engine.echo import EchoEngine

tok = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are terse and precise."}
A = [SYSTEM, {"role": "user", "content": "Conversation A is about lighthouses and fog."}]
A2 = [SYSTEM, {"role": "user", "content": "Conversation A is about lighthouses and rain."}]
B = [SYSTEM, {"role": "user", "content": "Sub-agent B greps the repository for to-do."}]
B2 = [SYSTEM, {"role": "user", "content": "Sub-agent B greps the repository for fix-me."}]


def make(can_rewind=True, park_bytes=1 << 20, slots=8, parking=True, device_bytes=0,
         device_resident=False, session_dir=None):
    engine = EchoEngine(can_rewind=can_rewind, device_resident=device_resident)
    gen = Generator(engine, tok, GeneratorSettings(checkpoint_interval=16))
    if parking:
        sessions = None
        if session_dir is not None:
            sessions = SessionStore(session_dir, expected_for(engine), min_tokens=1)
            sessions.scan()
        gen.parking = Conversations(ParkingPool(park_bytes, slots, device_budget_bytes=device_bytes),
                                    sessions)
    return gen


def chat(gen, messages):
    rendered = tok.render_chat(messages)
    out = list(gen.run(GenerationRequest(rendered.token_ids, message_ends=rendered.message_ends)))
    result = out[-1]
    assert isinstance(result, GenerationResult)
    assert gen.engine.held_ids == gen.held_ids
    return "".join(event.value for event in out[:-1]), result


def follow(messages, answer, user):
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]


def cold_answer(can_rewind, messages):
    return chat(make(can_rewind, parking=False), messages)[0]


def tail_tokens(entry):
    return len(entry.held_ids) - entry.base


@pytest.mark.parametrize("can_rewind", [True, False])
def test_regenerate_parks_only_the_tail(can_rewind, caplog):
    caplog.set_level(logging.INFO)
    gen = make(can_rewind)
    chat(gen, A)
    held = list(gen.held_ids)
    prompt_len = len(tok.render_chat(A).token_ids)
    _, result = chat(gen, A)  # regenerate: the same prompt again
    [entry] = gen.parking.pool.entries()
    keep = result.cached_tokens  # rewind: prompt - 1; recurrent: the checkpoint at the prompt's end
    assert keep == (prompt_len - 1 if can_rewind else prompt_len)
    assert (entry.parent, entry.base, entry.held_ids) == (LIVE, keep, held)
    assert entry.snapshot.nbytes == gen.engine.range_nbytes(0, len(held) - keep)  # the tail only
    assert entry.nbytes == entry.snapshot.nbytes + sum(c.nbytes for c in entry.checkpoints) + 8 * len(held)
    assert all(c.position > keep for c in entry.checkpoints)
    assert f"parked {len(held) - keep} tok ({entry.nbytes} bytes)" in caplog.text
    assert f"tokens [{keep}, {len(held)}) tier=ram" in caplog.text


@pytest.mark.parametrize("can_rewind", [True, False])
def test_fork_then_old_branch_restored_from_its_tail(can_rewind, caplog):
    caplog.set_level(logging.INFO)
    gen = make(can_rewind)
    answer_a, _ = chat(gen, A)
    a_held = len(gen.held_ids)
    chat(gen, A2)  # the edited message: a fork
    [entry] = gen.parking.pool.entries()
    assert entry.parent == LIVE and 0 < entry.base < a_held
    third = follow(A, answer_a, "And the fog horn?")
    prefilled = gen.engine.prefilled_tokens
    answer, result = chat(gen, third)
    assert result.cached_tokens == a_held
    assert gen.engine.prefilled_tokens - prefilled == len(tok.render_chat(third).token_ids) - a_held
    assert f"restored from ram {a_held} tok" in caplog.text and f"tail [{entry.base}, {a_held})" in caplog.text
    assert answer == cold_answer(can_rewind, third)
    # the A2 branch was parked as a tail in turn (the live prefix is shared again)
    [other] = gen.parking.pool.entries()
    assert other.parent == LIVE and other.base == entry.base


@pytest.mark.parametrize("can_rewind", [True, False])
def test_two_conversations_and_their_forks_hold_each_prefix_once(can_rewind):
    gen = make(can_rewind)
    answers, helds, cached = {}, {}, {}
    for name, messages in (("A", A), ("A2", A2), ("B", B), ("B2", B2)):
        answers[name], result = chat(gen, messages)
        helds[name], cached[name] = list(gen.held_ids), result.cached_tokens
    # what each switch kept of the live state: A2 kept A's prefix up to its fork, B kept the
    # system prompt of A2, B2 kept B's prefix up to its fork; the live state holds B2
    keep = {"A": cached["A2"], "A2": cached["B"], "B": cached["B2"]}
    assert 0 < keep["A2"] < keep["A"] and 0 < keep["B"]
    pool = gen.parking.pool
    entries = {tuple(e.held_ids): e for e in pool.entries()}
    assert len(entries) == 3
    for name in keep:
        entry = entries[tuple(helds[name])]
        assert entry.base == keep[name] and entry.is_tail
        assert entry.snapshot.nbytes == 8 * (len(helds[name]) - keep[name])
    assert sum(tail_tokens(e) for e in pool.entries()) == sum(len(helds[n]) - keep[n] for n in keep)
    # A's tail hangs on A2's entry (which holds A's prefix past the system prompt): nothing twice
    assert entries[tuple(helds["A"])].parent == entries[tuple(helds["A2"])].key
    for name, messages in (("A", A), ("A2", A2), ("B", B), ("B2", B2)):
        nxt = follow(messages, answers[name], "Go on.")
        answer, result = chat(gen, nxt)
        assert result.cached_tokens == len(helds[name])
        assert answer == cold_answer(can_rewind, nxt)


@pytest.mark.parametrize("via", ["reset", "rewind-below", "install"])
def test_live_cut_below_a_tail_makes_it_whole(via, caplog):
    """Whatever cuts or replaces the live state first gives the tails parked on it their
    prefix (``install``: the slot API's restore of a file, say)."""
    caplog.set_level(logging.INFO)
    gen = make()
    answer_a, _ = chat(gen, A)
    a_held = len(gen.held_ids)
    chat(gen, A2)
    [entry] = gen.parking.pool.entries()
    if via == "reset":
        reset(gen)  # the slot API's erase
        assert entry.parent is None and entry.base == 0
    elif via == "install":
        other = make(parking=False)
        chat(other, B)
        assert install(gen, capture(other, "slot", 0.0)) and gen.held_ids == other.held_ids
        assert entry.parent is None and entry.base == 0
    else:
        gen.parking.before_cut(gen, 3)  # as the generator does before rewinding to 3 tokens
        assert entry.parent == LIVE and entry.base == 3
    assert entry.snapshot.nbytes == 8 * (a_held - entry.base)
    assert "materialized" in caplog.text
    third = follow(A, answer_a, "Next.")
    answer, result = chat(gen, third)
    assert result.cached_tokens == a_held and answer == cold_answer(True, third)


def test_tails_of_a_failed_live_state_are_dropped(caplog):
    caplog.set_level(logging.INFO)
    gen = make()
    answer_a, _ = chat(gen, A)
    chat(gen, A2)
    assert len(gen.parking.pool) == 1
    gen.failed = True  # a request failed half-way: the live state is not trusted
    _, result = chat(gen, follow(A, answer_a, "Next."))
    assert "reason=live-state-lost" in caplog.text
    assert result.cached_tokens == 0 and len(gen.parking.pool) <= 1


def test_device_budget_then_host(caplog):
    caplog.set_level(logging.INFO)
    gen = make(device_resident=True, device_bytes=1500)
    moves = []
    gen.parking.on_timing = lambda kind, tier, seconds: moves.append((kind, tier))
    chat(gen, A)
    chat(gen, A2)  # first tail: fits the device budget
    chat(gen, A)   # second: the device is full, host memory
    pool = gen.parking.pool
    tiers = sorted(e.on_device for e in pool.entries())
    assert tiers == [False, True]
    assert pool.device_nbytes <= 1500 and pool.host_nbytes == sum(e.nbytes for e in pool.entries()
                                                                  if not e.on_device)
    assert "tier=device" in caplog.text and "tier=ram" in caplog.text
    assert "restored from device" in caplog.text  # the third request took A's tail back
    assert [m for m in moves if m[0] == "restore"] == [("restore", "device")]


def test_evicted_tail_goes_to_disk_whole(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    gen = make(park_bytes=0, session_dir=tmp_path)  # no RAM: a tail goes straight to disk
    answer_a, _ = chat(gen, A)
    a_held = list(gen.held_ids)
    chat(gen, A2)
    [saved] = gen.parking.sessions.entries()
    assert saved.held_ids == a_held  # whole: the prefix joined in
    chat(gen, B)
    third = follow(A, answer_a, "Next.")
    answer, result = chat(gen, third)
    assert result.cached_tokens == len(a_held) and "restored from disk" in caplog.text
    assert answer == cold_answer(True, third)


def test_stop_saves_tails_whole(tmp_path):
    gen = make(session_dir=tmp_path)
    answer_a, _ = chat(gen, A)
    a_held = list(gen.held_ids)
    chat(gen, A2)
    assert gen.parking.save_all(gen) == 2
    restarted = make(park_bytes=0, session_dir=tmp_path)
    third = follow(A, answer_a, "Next.")
    answer, result = chat(restarted, third)
    assert result.cached_tokens == len(a_held) and answer == cold_answer(True, third)


def test_eviction_takes_leaves_only():
    def stats(key, nbytes, parent=None, base=0, on_device=False, last_used=1.0):
        return EntryStats(key, nbytes, 100, last_used, base, parent, on_device)
    # the parent is worth least but has a dependant: the dependant goes first, then the parent
    entries = [stats("p", 500, last_used=0.0), stats("c", 100, parent="p", base=50, last_used=2.0),
               stats("x", 100, last_used=3.0)]
    assert plan_fit(entries, 650, 8) == ["c"]
    assert plan_fit(entries, 150, 8) == ["c", "p"]
    assert plan_fit(entries, 150, 8, protected=frozenset({"c"})) is None
    # device entries count against the device budget only
    entries = [stats("d", 400, on_device=True), stats("h", 400)]
    assert plan_fit(entries, 400, 8, device_budget_bytes=400) == []
    assert plan_fit(entries, 400, 8, device_budget_bytes=300) == ["d"]


# --- the scenario: two conversations, each answered, regenerated, then a second turn ----

X = [SYSTEM, {"role": "user", "content": "Conversation X: " + "a long brief about lighthouses. " * 12}]
Y = [SYSTEM, {"role": "user", "content": "Conversation Y: a short question about fog."}]


def regenerate(gen, messages, answer):
    """A sampled regenerate: the same prompt, another answer (its first token differs)."""
    rendered, ids = tok.render_chat(messages), tok.encode(answer)
    sampling = SamplingParams(logit_bias=((ids[0], -100.0), (END, -100.0)))
    out = list(gen.run(GenerationRequest(rendered.token_ids, message_ends=rendered.message_ends,
                                         sampling=sampling, max_tokens=len(ids))))
    assert gen.engine.held_ids == gen.held_ids
    return "".join(event.value for event in out[:-1]), out[-1]


def distinct_prefixes(branches):
    """Token states a set of branches needs when each shared prefix is held once (a trie)."""
    return len({tuple(ids[:i + 1]) for ids in branches for i in range(len(ids))})


@pytest.mark.parametrize("can_rewind", [True, False])
def test_six_requests_hold_each_shared_prefix_once(can_rewind, caplog):
    caplog.set_level(logging.INFO)
    gen = make(can_rewind)
    parks = []  # per switch: (tokens the live state held, tokens the new request kept of them)
    twice = 0  # tokens a switch prefills again (they are in the parked tail as well)

    def step(send):
        held = len(gen.held_ids)
        answer, result = send()
        if held:
            parks.append((held, result.cached_tokens))
            nonlocal twice
            twice += result.plan.common - result.cached_tokens
        return answer

    for messages in (X, Y):
        answer = step(lambda: chat(gen, messages))
        again = step(lambda: regenerate(gen, messages, answer))
        assert again != answer
        # the client sends the answer back re-rendered (its end differs, as a template that
        # drops the reasoning does) with a new user message: a rewind of a few tokens
        step(lambda: chat(gen, follow(messages, again[:-2], "And then?")))
    pool = gen.parking.pool
    entries = pool.entries()
    assert len(parks) == len(entries) == 5 and all(e.is_tail for e in entries)
    assert sorted((len(e.held_ids), e.base) for e in entries) == sorted(parks)
    for held, keep in parks:
        assert f"parked {held - keep} tok" in caplog.text
        assert re.search(rf"tokens \[{keep}, {held}\) tier=ram as parked-\d+ \(tail on the live "
                         rf"prefix \[0, {keep}\)\)", caplog.text)
    tails = sum(len(e.held_ids) - e.base for e in entries)
    # bytes: the state of the tails only (echo: 8 bytes a token), checkpoints past each base, ids
    assert sum(e.snapshot.nbytes for e in entries) == 8 * tails
    assert pool.nbytes == pool.host_nbytes == 8 * tails + sum(
        c.nbytes for e in entries for c in e.checkpoints) + 8 * sum(len(e.held_ids) for e in entries)
    assert all(c.position > e.base for e in entries for c in e.checkpoints)
    branches = [gen.held_ids] + [e.held_ids for e in entries]
    # each shared prefix once: the live state and the tails make a trie, but for the tokens a
    # switch prefills again (a rewind: the prompt's last token; a recurrent state: from its
    # checkpoint to the fork)
    assert tails + len(gen.held_ids) == distinct_prefixes(branches) + twice
    assert twice == 2 if can_rewind else 0 < twice < tails / 2



def test_a_fork_hashes_only_blocks_it_has_not_hashed(monkeypatch):
    """The prefix index's block hashes (about 1 ms per 32k tokens) are not computed twice: the
    held ids' are kept with the slot's sequence (:meth:`~redlite.core.sequence.Sequence.held_hashes`),
    a prompt's blocks that a parked branch holds are that branch's: forking back hashes only
    the blocks past the prefix the two branches share, not both sequences."""
    from redlite.core import prefix_index, sequence
    from redlite.core.reuse import common_prefix_length

    system = {"role": "system", "content": "You are terse and precise. " * 40}
    first, second = [system, A[1]], [system, A2[1]]
    gen = make()
    chat(gen, first)
    chat(gen, second)  # parks the first branch's tail
    held_second = list(gen.held_ids)
    [entry] = gen.parking.pool.entries()
    block = gen.parking.pool._index.block
    shared = common_prefix_length(entry.held_ids, held_second) // block
    assert shared >= 8  # the system prompt's blocks
    blocks = []
    real = prefix_index.block_hashes

    def counting(ids, size, limit=None, start=0, previous=b""):
        out = list(real(ids, size, limit, start, previous))
        blocks.append(len(out))
        return iter(out)
    monkeypatch.setattr(prefix_index, "block_hashes", counting)
    monkeypatch.setattr(sequence, "block_hashes", counting)
    chat(gen, first)  # back to the first branch: parks the second one's tail
    assert 0 < sum(blocks) <= len(held_second) // block - shared + 1