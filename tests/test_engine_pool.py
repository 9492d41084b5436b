"""The engine pool contract (engine/base.py): ``new_slot`` and the default ``decode_batch``,
on the echo engine."""

import pytest

from redlite.core.byte_tokenizer import END, USER
from redlite.engine.base import EngineError
from redlite.engine.echo import EchoEngine


def prompt(text: str) -> list[int]:
    return [USER, *text.encode(), END]


def test_a_new_slot_is_empty_and_independent():
    engine = EchoEngine(can_rewind=False, max_context=64, delay_ms=0.5)
    engine.prefill(prompt("abc"))
    slot = engine.new_slot()
    assert slot.n_past == 0 and slot.can_rewind is False and slot.max_context == 64
    assert slot.delay_ms == 0.5
    slot.prefill(prompt("xy"))
    assert engine.held_ids == prompt("abc") and slot.held_ids == prompt("xy")


def test_decode_batch_equals_each_decode_alone():
    texts = ["hello", "wo", "batch!"]
    pool = EchoEngine()
    slots = [pool] + [pool.new_slot() for _ in texts[1:]]
    alone = [EchoEngine() for _ in texts]
    batch_next = [slot.prefill(prompt(t)).next_token for slot, t in zip(slots, texts)]
    alone_next = [engine.prefill(prompt(t)).next_token for engine, t in zip(alone, texts)]
    for _ in range(8):
        assert batch_next == alone_next
        logits = pool.decode_batch(slots, batch_next)
        batch_next = [x.next_token for x in logits]
        alone_next = [engine.decode(t).next_token for engine, t in zip(alone, alone_next)]
    assert [s.held_ids for s in slots] == [e.held_ids for e in alone]


def test_decode_batch_refuses_a_full_context_before_changing_any_state():
    pool = EchoEngine(max_context=4)
    other = pool.new_slot()
    pool.prefill([1, 2])
    other.prefill([1, 2, 3, 4])
    with pytest.raises(EngineError, match="context overflow"):
        pool.decode_batch([pool, other], [5, 5])
    assert pool.n_past == 2 and other.n_past == 4


def test_decode_batch_refuses_repeated_slots_and_mismatched_lengths():
    pool = EchoEngine()
    pool.prefill([1])
    with pytest.raises(EngineError):
        pool.decode_batch([pool, pool], [2, 3])
    with pytest.raises(EngineError):
        pool.decode_batch([pool], [2, 3])
    assert pool.n_past == 1
