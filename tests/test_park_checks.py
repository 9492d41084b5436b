"""Parking checks sizes before acting: park_live does not copy a state that cannot be kept, and
park keeps the entries a new one would supersede until the new one is known to fit."""

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.conversations import Conversations
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest
from redlite.core.parking import ParkedEntry, ParkingPool
from redlite.engine.echo import EchoEngine

tok = ByteTokenizer()


class CountingEcho(EchoEngine):
    snapshots = 0

    def snapshot(self):
        self.snapshots += 1
        return super().snapshot()


def live(gen, content):
    prompt = tok.render_chat([{"role": "user", "content": content}]).token_ids
    list(gen.run(GenerationRequest(prompt, max_tokens=1)))


def make(budget):
    engine = CountingEcho()
    gen = Generator(engine, tok)
    conversations = Conversations(ParkingPool(budget, 8), None)
    return gen, conversations


def test_park_live_does_not_copy_a_state_that_cannot_be_kept():
    gen, conversations = make(budget=500)  # 16 bytes per token: ~30 tokens fit
    live(gen, "x" * 100)
    conversations.park_live(gen, frozenset())
    assert gen.engine.snapshots == 0 and len(conversations.pool) == 0
    small, _ = make(budget=1 << 20)
    live(small, "x" * 100)
    conversations = Conversations(ParkingPool(1 << 20, 8), None)
    conversations.park_live(small, frozenset())
    assert small.engine.snapshots == 1 and len(conversations.pool) == 1


def entry(key, ids):
    engine = EchoEngine()
    engine.prefill(ids)
    return ParkedEntry(key, list(ids), engine.snapshot(), [], 1.0, 1.0)


def test_park_keeps_a_shorter_entry_when_the_longer_one_does_not_fit():
    short, long = list(range(20)), list(range(20)) + list(range(100, 180))
    budget = entry("s", short).nbytes + 100  # the short one fits, the long one never does
    conversations = Conversations(ParkingPool(budget, 8), None)
    conversations.park(entry("s", short), frozenset(), can_rewind=True)
    conversations.park(entry("l", long), frozenset(), can_rewind=True)
    assert [e.key for e in conversations.pool.entries()] == ["s"]  # the pool did not end empty


def test_park_supersedes_a_shorter_entry_when_the_longer_one_fits():
    short, long = list(range(20)), list(range(20)) + list(range(100, 180))
    conversations = Conversations(ParkingPool(1 << 20, 8), None)
    conversations.park(entry("s", short), frozenset(), can_rewind=True)
    conversations.park(entry("l", long), frozenset(), can_rewind=True)
    assert [e.key for e in conversations.pool.entries()] == ["l"]


def test_superseded_entries_free_their_room_for_the_admission():
    short, long = list(range(40)), list(range(40)) + list(range(100, 110))
    # room for the long one only once the short one it extends has gone
    budget = entry("l", long).nbytes + 10
    conversations = Conversations(ParkingPool(budget, 8), None)
    conversations.park(entry("s", short), frozenset(), can_rewind=True)
    conversations.park(entry("l", long), frozenset(), can_rewind=True)
    assert [e.key for e in conversations.pool.entries()] == ["l"]


def test_a_regenerate_looks_up_no_parked_entry(monkeypatch):
    """A live state that keeps all a prompt can keep (the same prompt again) cannot lose to a
    parked entry (it wins ties): the pool's index is not searched; another prompt searches it."""
    gen, conversations = make(budget=1 << 20)
    gen.parking = conversations
    lookups = []
    real = conversations.pool.candidates
    monkeypatch.setattr(conversations.pool, "candidates", lambda *a, **k: lookups.append(1) or real(*a, **k))
    prompt = tok.render_chat([{"role": "user", "content": "lighthouses"}]).token_ids
    for _ in range(3):  # a new conversation, then twice the same prompt: its answer parked
        list(gen.run(GenerationRequest(prompt, max_tokens=4)))
    assert len(conversations.pool) == 1 and lookups == [1]  # only the first request searched
    list(gen.run(GenerationRequest(prompt[:-2] + [7, 7], max_tokens=4)))
    assert lookups == [1, 1]
