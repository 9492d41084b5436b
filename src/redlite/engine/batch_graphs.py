"""CUDA-graph replay of the batched decode step (:func:`redlite.models.batch_step.batch_decode_step`).

Two keys, after what the step's ops can do:

* ops with an address table (the Triton ops, :meth:`slot_table` not None): one graph per
  batch size. Its static int64 ``[2 + R, B]`` input holds the tokens, the positions and the
  states' address table (:mod:`redlite.models.slot_table`), all refilled from one pinned host
  tensor before each replay, so a graph captured on one set of slots serves any other set of
  as many slots. A size is captured the first time it is decoded (sizes are bounded by the
  pool's slots, so none is dropped); the slot warm-up's step of every size captures them all
  before the server reports ready.
* the torch ops (they take the states' tensors): a graph holds raw pointers into the caches
  (and hybrid conv/recurrent states) of the states it was captured with, so it serves one
  *set* of slots in one order (key: the states' identities and the span). A set is captured
  once it has been decoded ``capture_after`` steps in a row (earlier steps, and sets that keep
  changing, run the same step eagerly); the last ``max_graphs`` graphs are kept.

Every slot state is allocated once and never reallocated (reset, rewind, restore and
checkpoints copy into it), so addresses stay valid while the slots live. Spans: as the
single-sequence :class:`~redlite.engine.cuda_graphs.GraphDecoder` (one span with the Triton
ops, else power-of-two buckets of :func:`~redlite.engine.cuda_graphs.bucket_spans`).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Sequence

import torch

from redlite.engine.cuda_graphs import bucket_spans, choose_span
from redlite.engine.graph_capture import capture_graph
from redlite.engine.kernel_options import KernelOptions
from redlite.layers.decode_ops import TorchDecodeOps, decode_ops
from redlite.models.batch_step import batch_decode_step
from redlite.models.slot_table import table_rows

log = logging.getLogger("redlite.batch_graphs")


class BatchGraphs:
    """Batched decode steps of ``model`` over sets of slot states through captured graphs.

    ``use_graphs``: None captures on CUDA and runs the step eagerly elsewhere (tests).
    ``ops``: the per-sequence decode ops (default :func:`decode_ops` for the model's device,
    dtype and head size). ``capture_after`` (consecutive steps of one set before it is
    captured) and ``max_graphs`` (graphs kept) apply to graphs per set of slots;
    ``kernels``: the kernel options the default ops follow. Attributes ``by_size`` (graphs
    per batch size: the ops read the states by address), ``n_graphs``, ``captures`` (count
    so far), ``ops``, ``use_graphs``.
    """

    def __init__(self, model, template_state, use_graphs: bool | None = None, ops: TorchDecodeOps | None = None,
                 capture_after: int = 3, max_graphs: int = 8, kernels: KernelOptions | None = None):
        cache = template_state.cache.data
        self.model, self.device, self.dtype = model, cache.device, cache.dtype
        self.max_tokens = template_state.max_tokens
        kernels = kernels or KernelOptions()
        self.ops = ops or decode_ops(self.device, self.dtype, cache.shape[-1], cache.shape[2], model.linear,
                                     triton=kernels.triton, pdl=kernels.pdl, gemv_configs=kernels.gemv_configs,
                                     batch_invariant=kernels.batch_invariant)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        self.spans = [self.max_tokens] if self.ops.length_from_pos else bucket_spans(self.max_tokens)
        self.by_size = bool(self.ops.by_address)
        self.capture_after, self.max_graphs = max(1, int(capture_after)), max(1, int(max_graphs))
        self._tables = model.rotary.get(0, self.max_tokens, self.device, self.dtype)  # built before any capture
        # key -> (graph, static input, logits, states held)
        self._graphs: OrderedDict = OrderedDict()
        self._finite = weakref.WeakSet()  # states whose unused cache rows were zeroed
        self._last_key, self._streak = None, 0
        self._pool = None
        self.captures = 0

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def step(self, states: Sequence, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Feed ``token_ids[b]`` at ``states[b].n_past`` (room checked by the caller; every
        state has this pool's ``max_tokens``); ``token_ids`` host ints or an int64 ``[B]``
        tensor on the device. Returns float32 logits ``[B, vocab]`` (with a graph: its static
        buffer, overwritten by the next replay; copy it to keep it). Nothing here waits for the
        device (host values travel from pinned memory). ``n_past`` is left to the caller.
        Call under ``torch.inference_mode()``."""
        positions = [int(s.n_past) for s in states]
        span = choose_span(max(positions) + 1, self.spans)
        if not self.ops.length_from_pos:
            self._zero_unused(states)
        rows = [positions]
        if self.by_size:
            key = (len(states), span)
            rows += table_rows(states)
        else:
            key = (tuple(id(s) for s in states), span)
        self._streak = self._streak + 1 if key == self._last_key else 1
        self._last_key = key
        on_device = isinstance(token_ids, torch.Tensor)
        host = torch.tensor(rows if on_device else [list(token_ids), *rows], dtype=torch.long,
                            pin_memory=self.device.type == "cuda")
        entry = self._graphs.get(key)
        if entry is None:
            io = self._inputs(token_ids, host, None)
            if self.use_graphs and (self.by_size or self._streak >= self.capture_after):
                entry = self._capture(key, states, span, io)
            if entry is None:
                return batch_decode_step(self.model, io[0], io[1], states, span, self.ops, self._table(io))
        else:
            self._inputs(token_ids, host, entry[1])
        self._graphs.move_to_end(key)
        graph, _io, logits, _states = entry
        graph.replay()
        return logits

    def _inputs(self, token_ids, host: torch.Tensor, io: torch.Tensor | None) -> torch.Tensor:
        """The step's device inputs ``[2 (+ R), B]`` (tokens, positions, address table) from
        ``host`` (without the tokens row when ``token_ids`` is a device tensor), written into
        ``io`` (a graph's static input) or a new tensor."""
        if io is None:
            io = torch.empty((host.shape[0] + isinstance(token_ids, torch.Tensor), host.shape[1]),
                             dtype=torch.long, device=self.device)
        if isinstance(token_ids, torch.Tensor):
            io[0].copy_(token_ids)
            io[1:].copy_(host, non_blocking=True)
        else:
            io.copy_(host, non_blocking=True)
        return io

    def _table(self, io: torch.Tensor) -> torch.Tensor | None:
        return io[2:] if self.by_size else None

    def _zero_unused(self, states) -> None:
        """The torch ops read ``span`` rows and mask the ones past each position: keep those
        rows finite (zeroed once per state; later writes are finite values)."""
        for state in states:
            if state not in self._finite:
                state.cache.data[:, :, :, state.n_past:].zero_()
                self._finite.add(state)

    def _capture(self, key, states, span: int, io: torch.Tensor):
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels), put back what the
        warm-up changed (recurrent states; the KV rows it wrote are written again identically
        by the replay that follows), then capture with ``io`` as the static input. A failure
        is logged and the step runs eagerly from then on (None)."""
        saved = [s.export_recurrent() if hasattr(s, "export_recurrent") else None for s in states]
        table = self._table(io)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                batch_decode_step(self.model, io[0], io[1], states, span, self.ops, table)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for state, payload in zip(states, saved):
                if payload is not None:
                    state.import_recurrent(payload, state.n_past)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph, logits = capture_graph(
                lambda: batch_decode_step(self.model, io[0], io[1], states, span, self.ops, table), self.device,
                self._pool)
        except Exception:  # noqa: BLE001 - any capture trouble: this set decodes eagerly
            log.exception("batched decode graph capture failed for %d slots; eager", len(states))
            for state, payload in zip(states, saved):
                if payload is not None:
                    state.import_recurrent(payload, state.n_past)
            self.use_graphs = False
            return None
        self.captures += 1
        # a size's graph keeps no state alive (it reads addresses); a set's keeps its states' ids unique
        self._graphs[key] = (graph, io, logits, () if self.by_size else tuple(states))
        while not self.by_size and len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return self._graphs[key]

    def forget(self, state) -> None:
        """Drop the graphs that hold ``state`` (call before the state is freed); graphs per
        batch size hold none."""
        for key in [k for k, entry in self._graphs.items() if any(s is state for s in entry[3])]:
            del self._graphs[key]
        self._finite.discard(state)
