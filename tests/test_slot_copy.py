"""A slot starting from another slot's prefix (``Engine.copy_prefix``, a fork by copy): on the
echo engine and on tiny random torch models (a Llama: KV rows only; the Qwen3.5 hybrid: KV rows
of its attention layers plus the source's checkpoint), the copied slot continues as a cold
prefill of that prefix does, and the source slot is left as it was."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.base import Engine, EngineError
from redlite.engine.echo import EchoEngine
from redlite.engine.torch_engine import TorchEngine
from test_hybrid_decode import make_model as make_hybrid
from test_slot_pool import make_llama, prompts

pytestmark = pytest.mark.timeout(120)


def greedy(engine, logits, n: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    tokens, rows = [], [logits]
    for _ in range(n):
        tokens.append(int(rows[-1].argmax()))
        rows.append(engine.decode(tokens[-1]))
    return tokens, rows



def assert_continues_as_cold(slot, model, prefix: list[int], tail: list[int]) -> None:
    """``slot`` (holding ``prefix``) fed ``tail`` decodes greedily as a cold engine fed both."""
    got = greedy(slot, slot.prefill(tail))
    cold = TorchEngine(model, ctx_size=64, device="cpu")
    want = greedy(cold, cold.prefill(prefix + tail))
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert torch.allclose(a, b, atol=1e-4)

def test_llama_slot_continues_from_a_copied_prefix_as_a_cold_prefill():
    model = make_llama()
    pool = TorchEngine(model, ctx_size=64, device="cpu")
    source, slot = pool, pool.new_slot()
    ids, other, tail = prompts(96, lengths=(20, 9, 4))
    source.prefill(ids)
    slot.prefill(other)  # something to overwrite
    before = source.snapshot()
    slot.copy_prefix(source, 12)
    assert slot.n_past == 12 and source.n_past == 20
    assert_continues_as_cold(slot, model, ids[:12], tail)
    assert torch.equal(source.snapshot().tensors["kv"], before.tensors["kv"])  # untouched


def test_hybrid_slot_continues_from_copied_rows_and_a_checkpoint():
    model = make_hybrid()
    pool = TorchEngine(model, ctx_size=64, device="cpu")
    source, slot = pool, pool.new_slot()
    ids, tail = prompts(120, lengths=(20, 5))
    checkpoint = source.take_checkpoint(source.prefill(ids[:11]))
    source.prefill(ids[11:])
    held = source.snapshot()
    slot.prefill(tail)
    slot.copy_prefix(source, 11)
    slot.restore_checkpoint(checkpoint)
    assert_continues_as_cold(slot, model, ids[:11], tail)
    after = source.snapshot()
    for name, tensor in held.tensors.items():
        assert torch.equal(after.tensors[name], tensor), name


def test_hybrid_copy_of_the_whole_state_takes_the_recurrent_part_too():
    model = make_hybrid()
    pool = TorchEngine(model, ctx_size=64, device="cpu")
    source, slot = pool, pool.new_slot()
    ids, tail = prompts(120, lengths=(14, 3))
    source.prefill(ids)
    slot.copy_prefix(source, 14)
    want = source.prefill(tail)
    assert torch.allclose(slot.prefill(tail), want, atol=1e-5)


def test_copies_outside_the_pool_or_the_held_range_are_refused():
    model = make_llama()
    pool = TorchEngine(model, ctx_size=32, device="cpu")
    slot = pool.new_slot()
    pool.prefill([1, 2, 3])
    for source, n in ((pool, 4), (slot, 0), (TorchEngine(model, ctx_size=32, device="cpu"), 0)):
        with pytest.raises(EngineError):
            slot.copy_prefix(source, n)


@pytest.mark.parametrize("can_rewind", [True, False])
def test_echo_copy(can_rewind):
    source = EchoEngine(can_rewind=can_rewind)
    slot = source.new_slot()
    logits = source.prefill(list(b"<abc>"))
    checkpoint = source.take_checkpoint(logits)
    source.prefill(list(b"def"))
    slot.prefill(list(b"zz"))
    slot.copy_prefix(source, 5)
    if not can_rewind:
        slot.restore_checkpoint(checkpoint)
    assert slot.held_ids == list(b"<abc>") and source.held_ids == list(b"<abc>def")
    slot.copy_prefix(source, 8)
    assert slot.decode(0).next_token == source.decode(0).next_token
    with pytest.raises(EngineError):
        slot.copy_prefix(slot, 1)
    Engine.copy_prefix(slot, source, 4)  # the contract's default: through token ranges
    assert slot.held_ids == list(b"<abc")
    with pytest.raises(EngineError):
        Engine.copy_prefix(slot, source, 99)
