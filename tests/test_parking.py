"""Pure parts of parking: the prefix index, usable prefixes, candidate choice, eviction plans."""

import random

import numpy as np
import pytest

from redlite.core.eviction import EntryStats, entry_values, plan_eviction
from redlite.core.parking import (LIVE, Candidate, ParkedEntry, ParkingPool, choose_candidate,
                                  usable_prefix)
from redlite.core.prefix_index import PrefixIndex, block_hashes
from redlite.core.reuse import common_prefix_length, plan_reuse
from redlite.engine.base import StateSnapshot


def random_family(rng, n, vocab=4, length=60):
    """Sequences that share prefixes a lot (small vocab, copied stems)."""
    seqs = []
    for _ in range(n):
        if seqs and rng.random() < 0.7:
            base = rng.choice(seqs)
            cut = rng.randint(0, len(base))
            seqs.append(base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(0, length))])
        else:
            seqs.append([rng.randrange(vocab) for _ in range(rng.randint(0, length))])
    return seqs


@pytest.mark.parametrize("block", [1, 4, 16])
def test_index_groups_bound_the_common_prefix(block):
    rng = random.Random(block)
    for _ in range(30):
        seqs = random_family(rng, 12)
        index = PrefixIndex(block)
        for i, s in enumerate(seqs):
            index.add(i, s)
        prompt = random_family(rng, 1)[0] if rng.random() < 0.3 else \
            rng.choice(seqs)[:rng.randint(0, 60)] + [rng.randrange(4) for _ in range(rng.randint(1, 20))]
        groups = index.lookup(prompt)
        seen = [k for g in groups for k in g.keys]
        assert sorted(seen) == list(range(len(seqs)))  # every key exactly once
        assert [g.blocks for g in groups] == sorted((g.blocks for g in groups), reverse=True)
        for group in groups:
            for key in group.keys:
                common = common_prefix_length(seqs[key], prompt)
                assert group.blocks * block <= common < group.bound


def test_index_hashes_and_lookups_reuse_indexed_and_given_hashes_exactly():
    """Hashes of a sequence through the index (given leading hashes, those of indexed
    sequences sharing blocks with it, the rest hashed) equal block_hashes of the sequence
    itself, and a lookup given any leading part of them groups as one given none."""
    rng = random.Random(5)
    for block in (1, 3, 8):
        for _ in range(40):
            seqs = random_family(rng, 8)
            index = PrefixIndex(block)
            for i, s in enumerate(seqs):
                index.add(i, s)
            other = rng.choice(seqs)[:rng.randint(0, 60)] + [rng.randrange(4) for _ in range(rng.randint(0, 9))]
            truth = list(block_hashes(other, block))
            given = truth[:rng.randint(0, len(truth))]
            assert index.hashes(other) == truth and index.hashes(other, given) == truth
            plain = [(g.blocks, g.keys) for g in index.lookup(other)]
            assert [(g.blocks, g.keys) for g in index.lookup(other, given)] == plain
            assert [(g.blocks, g.keys) for g in index.lookup(other, truth)] == plain


def test_sequence_keeps_its_held_hashes_through_appends_cuts_and_replacements():
    from redlite.core.checkpoints import CheckpointStore
    from redlite.core.sequence import Sequence

    rng = random.Random(9)
    seq = Sequence(None, CheckpointStore(0))
    for _ in range(300):
        step = rng.random()
        if step < 0.4:
            seq.held_ids.extend(rng.randrange(4) for _ in range(rng.randint(0, 9)))
        elif step < 0.7:
            seq.cut(rng.randint(0, len(seq.held_ids)))
        elif step < 0.8:
            seq.held_ids = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        elif step < 0.9:
            seq.held_ids = list(seq.held_ids)
            seq.know_hashes(3, list(block_hashes(seq.held_ids, 3))[:rng.randint(0, 4)])
        block = rng.choice((1, 3, 8))
        truth = list(block_hashes(seq.held_ids, block))
        blocks = rng.choice((None, rng.randint(0, 12)))
        assert seq.held_hashes(block, blocks) == truth[:blocks]


def test_index_remove_and_replace():
    index = PrefixIndex(2)
    index.add("a", [1, 2, 3, 4])
    index.add("b", [1, 2, 9, 9])
    assert [g.keys for g in index.lookup([1, 2, 3, 4, 5])] == [["a"], ["b"]]
    index.add("a", [7, 7])  # replaced
    assert [g.keys for g in index.lookup([1, 2, 3, 4, 5])] == [["b"], ["a"]]
    index.remove("b")
    index.remove("missing")
    assert len(index) == 1 and "b" not in index
    assert index._levels.keys() == {(1, next(iter(index._hashes["a"])))}


def test_usable_prefix_matches_the_reuse_planner():
    rng = random.Random(7)
    for _ in range(3000):
        held = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        prompt = held[:rng.randint(0, len(held))] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
        if not prompt:
            prompt = [0]
        can_rewind = rng.random() < 0.5
        positions = sorted(rng.sample(range(1, len(held) + 1), rng.randint(0, len(held)))) if held else []
        plan = plan_reuse(held, prompt, can_rewind, positions)
        common = common_prefix_length(held, prompt)
        assert usable_prefix(len(held), common, len(prompt), can_rewind, positions) == plan.keep


def test_choice_prefers_longest_then_live_then_ram_then_recent():
    assert choose_candidate([Candidate(LIVE, 0, "live")]) is None
    cands = [Candidate(LIVE, 5, "live"), Candidate("r", 9, "ram"), Candidate("d", 12, "disk")]
    assert choose_candidate(cands).key == "d"
    cands = [Candidate(LIVE, 9, "live"), Candidate("r", 9, "ram"), Candidate("d", 9, "disk")]
    assert choose_candidate(cands).key == LIVE
    cands = [Candidate("d", 9, "disk", 100.0), Candidate("r1", 9, "ram", 1.0), Candidate("r2", 9, "ram", 2.0)]
    assert choose_candidate(cands).key == "r2"


def stats(key, nbytes, tokens=None, last_used=0.0):
    return EntryStats(key, nbytes, nbytes // 8 if tokens is None else tokens, last_used)


def test_eviction_keeps_the_pool_within_bounds_randomly():
    rng = random.Random(3)
    for trial in range(200):
        budget, slots = rng.randint(100, 2000), rng.randint(1, 6)
        current: list[EntryStats] = []
        for step in range(30):
            new = stats(f"n{trial}-{step}", rng.randint(10, 900), rng.randint(1, 300), float(step))
            protected = frozenset(rng.sample([e.key for e in current], min(len(current), rng.randint(0, 1))))
            plan = plan_eviction(current, new, budget, slots, protected)
            assert not set(plan.evict) & protected
            assert new.key not in plan.evict
            if not plan.admit:
                assert plan.evict == []  # never evict others for an entry that is not stored
                continue
            current = [e for e in current if e.key not in plan.evict] + [new]
            assert sum(e.nbytes for e in current) <= budget
            assert len(current) <= slots


def test_eviction_rule_value_per_byte_and_recency():
    # equal size: the least recently used goes
    old, mid = stats("old", 100, 10, 1.0), stats("mid", 100, 10, 2.0)
    plan = plan_eviction([old, mid], stats("new", 100, 10, 3.0), 250, 8)
    assert plan == plan.__class__(True, ["old"])
    # a long conversation saves more prefill per byte (attention grows with the position)
    values = entry_values([stats("short", 8_000, 1_000, 2.0), stats("long", 80_000, 10_000, 2.0)])
    assert values["long"] > values["short"]
    # an entry that is worth least is not stored at all
    fat = stats("fat", 200, 1, 0.5)  # saves one token for 200 bytes
    big = stats("big", 200, 300, 5.0)
    plan = plan_eviction([big], fat, 300, 8)
    assert plan.admit is False and plan.evict == []
    # protected entries stay even when they are worth least
    plan = plan_eviction([old, mid], stats("new", 100, 10, 3.0), 250, 8, frozenset({"old"}))
    assert plan.evict == ["mid"]
    # too big for the budget by itself
    assert plan_eviction([], stats("huge", 1000), 999, 8).admit is False
    assert plan_eviction([], stats("x", 10), 999, 0).admit is False


def entry(key, ids, last_used=0.0):
    snap = StateSnapshot(len(ids), {"held": np.asarray(ids, dtype=np.int64)}, tensor_format="numpy")
    return ParkedEntry(key, list(ids), snap, [], last_used, last_used)


def test_pool_candidates_verify_by_tokens_and_skip_hopeless_groups():
    pool = ParkingPool(1 << 20, 8, block=4)
    a = list(range(40))
    pool.add(entry("a", a))
    pool.add(entry("b", a[:10] + [99] * 10))
    pool.add(entry("c", [5, 5, 5]))
    found = {c.key: c.usable for c in pool.candidates(a + [1, 2], True)}
    assert found == {"a": 40}  # b (common 10) and c cannot beat 40: not even compared
    found = {c.key: c.usable for c in pool.candidates(a[:12] + [7], True)}
    assert found == {"a": 12}  # b shares 2 blocks (common < 12): skipped
    found = {c.key: c.usable for c in pool.candidates(a[:10] + [99] * 12, True)}
    assert found == {"b": 20}  # a (common 10 < 12) cannot beat 20: skipped
    assert pool.candidates([5, 5, 5, 5], True)[0].usable == 3
    assert pool.candidates([5, 5, 5, 5], True, best_so_far=4) == []
    assert sorted(pool.prefixes_of(a + [1])) == ["a"]
    assert pool.pop("a").key == "a" and "a" not in pool


def test_superseded_tails_on_the_live_state_are_compared_past_their_base():
    """Given the live state's ids, an entry on the live state is taken to hold them up to its
    base (the forks invariant) and compared past it only; other entries and other ids in full."""
    pool = ParkingPool(1 << 20, 8, block=4)
    live = list(range(30))
    tail = entry("tail", [7] * 20 + live[20:26])  # its first 20 ids: not the live ones here
    tail.base, tail.parent = 20, LIVE
    pool.add(tail)
    pool.add(entry("whole", [7] * 20 + live[20:26]))
    assert pool.prefixes_of(live, live=True) == ["tail"]
    assert pool.prefixes_of(live) == []
    tail.held_ids[-1] = 99  # past its base: compared
    assert pool.prefixes_of(live, live=True) == []


@pytest.mark.parametrize("can_rewind", [True, False])
def test_pool_choice_equals_comparing_every_entry(can_rewind):
    """The pool's candidates (groups pruned by what can beat the live state, tail entries on the
    live state compared from their base) lead to the choice that comparing every entry with
    the prompt gives: same key, same usable prefix."""
    from redlite.core.parking import ParkedCheckpoint, entry_fit

    rng = random.Random(11 + can_rewind)
    for _ in range(200):
        live = random_family(rng, 1, length=40)[0]
        pool = ParkingPool(1 << 20, 16, block=rng.choice([2, 4, 8]))
        for i, ids in enumerate(random_family(rng, rng.randint(0, 8), length=40)):
            if live and rng.random() < 0.6:  # a tail on the live state: its first base ids are live's
                base = rng.randint(1, len(live))
                ids = live[:base] + ids[:rng.randint(0, len(ids))]
                e = entry(f"t{i}", ids, last_used=rng.random())
                e.base, e.parent = base, LIVE
            else:
                e = entry(f"w{i}", ids, last_used=rng.random())
            e.checkpoints = [ParkedCheckpoint(p, False, 0) for p in sorted(rng.sample(range(1, 41), 3))
                             if p <= len(e.held_ids)]
            pool.add(e)
        prompt = live[:rng.randint(0, len(live))] + [rng.randrange(4) for _ in range(rng.randint(1, 9))]
        common = common_prefix_length(live, prompt)
        live_usable = usable_prefix(len(live), common, len(prompt), can_rewind, [])
        live_candidate = Candidate(LIVE, live_usable, "live", 0.0)
        known = list(block_hashes(live, pool.block))[:common // pool.block]  # the live state's
        fast = choose_candidate([live_candidate] + pool.candidates(prompt, can_rewind, live_usable, common, known))
        every = [Candidate(e.key, entry_fit(e, prompt, can_rewind)[1], e.tier, e.last_used, len(e.held_ids))
                 for e in pool.entries()]
        slow = choose_candidate([live_candidate] + every)
        assert (fast and (fast.key, fast.usable)) == (slow and (slow.key, slow.usable))


def test_a_parked_state_is_restored_only_when_it_saves_enough():
    from redlite.core.parking import RESTORE_MIN_TOKENS, Candidate, choose_candidate

    huge = Candidate("disk-conv", usable=1, tier="disk", held_len=54007)  # "hi" vs a 54k conversation
    small = Candidate("ram-conv", usable=30, tier="ram", held_len=50)    # most of a small one
    assert choose_candidate([huge]) is None
    assert choose_candidate([huge, small]).key == "ram-conv"
    assert choose_candidate([Candidate("d", RESTORE_MIN_TOKENS, "disk", held_len=10**6)]).key == "d"
    assert choose_candidate([Candidate("live", 1, "live", held_len=54007)]).key == "live"  # nothing read
