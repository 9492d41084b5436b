"""The torch engine as a pool of sequence slots: :func:`new_slot` and :func:`decode_batch`
behind :meth:`TorchEngine.new_slot <redlite.engine.torch_engine.TorchEngine.new_slot>` and
:meth:`TorchEngine.decode_batch <redlite.engine.torch_engine.TorchEngine.decode_batch>`.

Memory: a slot is a :class:`~redlite.engine.torch_engine.TorchEngine` over the same model
object (weights are never copied) with its own :class:`~redlite.models.base.ModelState`: a
fixed KV region of ``ctx_size`` tokens (``[layers, 2, Hkv, ctx_size, D]``, allocated
uninitialised when the slot is made) plus, for the hybrid, its fixed-size conv/recurrent
states. Why fixed regions rather than pages: a slot is then exactly a single-sequence engine
(snapshots, token ranges, checkpoints, parking and the CUDA-graph path need no change, and a
parked conversation restores into any slot); attention reads one contiguous cache per
sequence; on CPU untouched pages of ``torch.empty`` cost no memory, so a slot costs what its
tokens fill. The price is on CUDA, where the whole region is reserved: N slots take N times
one slot's KV (``ctx_size x`` the per-token bytes), so size ``--ctx-size`` per conversation
with ``--parallel`` in mind (llama.cpp instead splits its ``--ctx-size`` among ``--parallel``
slots; here ``--ctx-size`` stays what each conversation may hold).

A slot made on CUDA keeps its own CUDA-graph decoder for its single-sequence decode (built on
its first lone decode); :func:`decode_batch` of two or more slots runs eagerly (one batched
forward, :func:`redlite.models.batch_decode.forward_batch`), of one slot the slot's own decode.
"""

from __future__ import annotations

from typing import Sequence

import torch

from redlite.engine.base import Engine, EngineError


def new_slot(engine) -> "Engine":
    """A :class:`~redlite.engine.torch_engine.TorchEngine` sharing ``engine``'s model,
    device, dtype, ``ctx_size``, prefill chunk, decode path and fingerprint, with a fresh empty
    state (see the module docstring for its memory). Raises :class:`EngineError` when the state
    cannot be allocated (out of memory)."""
    from redlite.engine.torch_engine import TorchEngine

    try:
        slot = TorchEngine(engine.model, model_id=engine.model_id, ctx_size=engine.max_context,
                           device=engine.device, dtype=engine.dtype, prefill_chunk=engine.prefill_chunk,
                           cuda_graphs=engine._use_graphs)
    except torch.OutOfMemoryError as err:
        raise EngineError(f"no memory for another slot of {engine.max_context} tokens: {err}") from err
    slot._shared = engine._shared
    return slot


def decode_batch(engine, slots: Sequence[Engine], token_ids: Sequence[int]) -> list[torch.Tensor]:
    """Feed ``token_ids[i]`` to ``slots[i]`` (distinct slots of ``engine``'s pool) in one
    forward pass; return float32 logits ``[vocab]`` per slot, each what
    ``slots[i].decode(token_ids[i])`` returns alone (bitwise for quantized CPU weights, to
    float rounding for dense ones: see :mod:`redlite.models.batch_decode`). Raises
    :class:`EngineError`, before changing any state, for a slot of another pool, a repeated
    slot, a count mismatch, an id out of range or a full context."""
    from redlite.models.batch_decode import forward_batch, supports_batch

    if len(slots) != len(token_ids):
        raise EngineError(f"{len(slots)} slots but {len(token_ids)} tokens")
    if len({id(slot) for slot in slots}) != len(slots):
        raise EngineError("decode_batch needs distinct slots")
    for slot, token_id in zip(slots, token_ids):
        if getattr(slot, "_shared", None) is not engine._shared:
            raise EngineError("decode_batch takes slots of this engine's pool only")
        if slot.n_past >= slot.max_context:
            raise EngineError(f"context overflow: ctx_size {slot.max_context} tokens held")
        if not 0 <= int(token_id) < engine.vocab_size:
            raise EngineError(f"token id {token_id} out of range [0, {engine.vocab_size})")
    if len(slots) <= 1 or not supports_batch(engine.model):
        return [slot.decode(int(token_id)) for slot, token_id in zip(slots, token_ids)]
    with torch.inference_mode():
        logits = forward_batch(engine.model, [int(t) for t in token_ids], [slot.state for slot in slots])
    return [row.clone() for row in logits]  # normal tensors (not inference ones), as decode gives
