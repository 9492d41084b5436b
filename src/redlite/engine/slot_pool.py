"""The torch engine as a pool of sequence slots: :func:`new_slot` and :func:`decode_batch`
behind :meth:`TorchEngine.new_slot <redlite.engine.torch_engine.TorchEngine.new_slot>` and
:meth:`TorchEngine.decode_batch <redlite.engine.torch_engine.TorchEngine.decode_batch>`, and
:func:`copy_prefix` (a slot starting from another slot's prefix) behind ``TorchEngine.copy_prefix``.

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
its first lone decode); :func:`decode_batch` of one slot is that slot's own decode, of two or
more one batched step: replayed from a graph per set of slots
(:class:`~redlite.engine.batch_graphs.BatchGraphs`, when the engine decodes through graphs),
else eager (:func:`redlite.models.batch_decode.forward_batch`). On CPU with ``cuda_graphs``
True the graph step runs eagerly (tests), as the single-sequence one does.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from redlite.engine.base import Engine, EngineError
from redlite.engine.picks import PICKED, PickHandle, mark_picks, pick_of, resolve_picks

log = logging.getLogger("redlite.engine")


def new_slot(engine) -> "Engine":
    """A :class:`~redlite.engine.torch_engine.TorchEngine` sharing ``engine``'s model,
    device, dtype, ``ctx_size``, prefill chunk, decode path and fingerprint, with a fresh empty
    state (see the module docstring for its memory). Raises :class:`EngineError` when the state
    cannot be allocated (out of memory)."""
    from redlite.engine.torch_engine import TorchEngine

    try:
        slot = TorchEngine(engine.model, model_id=engine.model_id, ctx_size=engine.max_context,
                           device=engine.device, dtype=engine.dtype, prefill_chunk=engine.prefill_chunk,
                           cuda_graphs=engine._use_graphs, kernels=engine.kernels)
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
        if int(token_id) == PICKED:
            pick_of(slot)
        elif not 0 <= int(token_id) < engine.vocab_size:
            raise EngineError(f"token id {token_id} out of range [0, {engine.vocab_size})")
    graphs = batch_graphs(engine) if len(slots) > 1 and supports_batch(engine.model) else None
    if graphs is None:
        token_ids = resolve_picks(slots, token_ids)
    if len(slots) <= 1 or not supports_batch(engine.model):
        return [slot.decode(int(token_id)) for slot, token_id in zip(slots, token_ids)]
    states = [slot.state for slot in slots]
    with torch.inference_mode():
        if graphs is None:
            logits = forward_batch(engine.model, [int(t) for t in token_ids], states)
        else:
            logits = graphs.step(states, device_tokens(slots, token_ids, graphs.device))
            for state in states:
                state.n_past += 1
    return [row.clone() for row in logits]  # normal tensors (not inference ones), as decode gives


def copy_prefix(engine, source: Engine, n_tokens: int) -> None:
    """:meth:`Engine.copy_prefix`: ``source``'s KV rows ``[0, n_tokens)`` (every attention layer)
    copied into ``engine``'s cache in place, on the device (no host copy), behind the work
    already queued there; ``n_past`` becomes ``n_tokens``. Recurrent states are copied only
    with the whole held state (``n_tokens == source.n_past``); else restore ``source``'s
    checkpoint at ``n_tokens``. Raises :class:`EngineError` for ``engine`` itself, a slot of
    another pool or ``n_tokens`` out of range."""
    if source is engine or getattr(source, "_shared", None) is not engine._shared:
        raise EngineError("copy_prefix takes another slot of this engine's pool")
    n = int(n_tokens)
    if not 0 <= n <= min(source.n_past, engine.max_context):
        raise EngineError(f"cannot copy {n} of {source.n_past} tokens")
    with torch.inference_mode():
        engine.state.cache.data[:, :, :, :n].copy_(source.state.cache.data[:, :, :, :n])
        engine.state.n_past = n
        if n == source.n_past and hasattr(source.state, "export_recurrent"):
            engine.state.import_recurrent(source.state.export_recurrent(), n)


class DevicePicks(PickHandle):
    """Greedy ids of a batch left where the logits are: ``tokens`` (int64 ``[B]`` on their
    device, fed by :func:`device_tokens`); on CUDA copied to pinned host memory behind the step
    and read after its event (on CPU read directly)."""

    def __init__(self, rows: Sequence[torch.Tensor]) -> None:
        super().__init__(read=self._read_back)
        with torch.inference_mode():
            self.tokens = torch.stack(list(rows)).argmax(dim=-1)
            self._event = None
            if self.tokens.device.type == "cuda":
                self._host = torch.empty(self.tokens.shape, dtype=torch.int64, pin_memory=True)
                self._host.copy_(self.tokens, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()

    def _read_back(self) -> list[int]:
        if self._event is None:
            return self.tokens.tolist()
        self._event.synchronize()
        return self._host.tolist()


def greedy_batch_async(engine, slots: Sequence[Engine], rows: Sequence[torch.Tensor]) -> PickHandle:
    """:meth:`Engine.greedy_batch_async`: :class:`DevicePicks` (on CUDA nothing waits for the
    step) when the pool's batched steps run through :class:`BatchGraphs` (they can take the
    picks as a tensor); else the ids are read at once."""
    if not rows or batch_graphs(engine) is None:
        return mark_picks(slots, PickHandle(engine.greedy_batch(rows)))
    return mark_picks(slots, DevicePicks(rows))


def device_tokens(slots: Sequence[Engine], token_ids: Sequence[int], device) -> torch.Tensor | list[int]:
    """``token_ids`` for a batched step: a plain list when every id is on the host; else an
    int64 ``[B]`` tensor on ``device`` assembled there (the :data:`PICKED` rows gathered from
    their :class:`DevicePicks`, host ids copied from pinned memory without waiting)."""
    picks = [pick_of(slot) if int(t) == PICKED else None for slot, t in zip(slots, token_ids)]
    if all(p is None for p in picks):
        return [int(t) for t in token_ids]
    if any(p is not None and not isinstance(p[0], DevicePicks) for p in picks):
        return resolve_picks(slots, token_ids)
    first = picks[0][0] if picks[0] is not None else None
    if first is not None and all(p is not None and p[0] is first and p[1] == row for row, p in enumerate(picks)) \
            and first.tokens.numel() == len(picks):
        return first.tokens  # the same slots in the same order as the step that picked them
    pinned = torch.device(device).type == "cuda"
    host = torch.tensor([0 if p is not None else int(t) for p, t in zip(picks, token_ids)],
                        dtype=torch.int64, pin_memory=pinned)
    tokens = host.to(device, non_blocking=True)
    by_handle: dict = {}
    for row, pick in enumerate(picks):
        if pick is not None:
            by_handle.setdefault(id(pick[0]), (pick[0], [], []))
            by_handle[id(pick[0])][1].append(row)
            by_handle[id(pick[0])][2].append(pick[1])
    for handle, rows, sources in by_handle.values():
        index = torch.tensor([rows, sources], dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=True)
        tokens[index[0]] = handle.tokens[index[1]]
    return tokens


def batch_graphs(engine):
    """The pool's :class:`~redlite.engine.batch_graphs.BatchGraphs` (built on first use) when
    the engine decodes through graphs (``cuda_graphs``) and the model has a batched step; else
    None (eager :func:`~redlite.models.batch_decode.forward_batch`). A build failure is
    logged and the pool decodes eagerly from then on."""
    shared = engine._shared
    if not engine._use_graphs or shared.get("batch_graphs") is False:
        return None
    if shared.get("batch_graphs") is None:
        from redlite.engine.batch_graphs import BatchGraphs

        try:
            shared["batch_graphs"] = BatchGraphs(engine.model, engine.state, kernels=engine.kernels)
        except Exception:  # noqa: BLE001 - any trouble: the eager batched forward serves
            log.exception("batched decode graphs unavailable; eager batched decode")
            shared["batch_graphs"] = False
            return None
    graphs = shared["batch_graphs"]
    return graphs if graphs.use_graphs or engine.device.type == "cpu" else None
