"""CUDA-graph replay of the batched decode step (:func:`redlite.models.batch_step.batch_decode_step`).

A captured graph holds raw pointers into the caches (and hybrid conv/recurrent states) of the
very states it was captured with, so a graph serves one *set* of slots in one order (key: the
states' identities and the span); tokens and positions are copied into its static ``[B]``
tensors before each replay. Every slot state is allocated once and never reallocated (reset,
rewind, restore and checkpoints copy into it), so a graph stays valid while its slots live.

Capture policy: a set of slots is captured once it has been decoded ``capture_after`` steps
in a row (earlier steps, and sets that keep changing, run the same step eagerly), so a batch
whose membership changes every few tokens does not pay a capture per step; the last
``max_graphs`` graphs are kept (least recently used dropped). Spans: as the single-sequence
:class:`~redlite.engine.cuda_graphs.GraphDecoder` (one span with the Triton ops, else
power-of-two buckets of :func:`~redlite.engine.cuda_graphs.bucket_spans`).
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

log = logging.getLogger("redlite.batch_graphs")


class BatchGraphs:
    """Batched decode steps of ``model`` over sets of slot states through captured graphs.

    ``use_graphs``: None captures on CUDA and runs the step eagerly elsewhere (tests).
    ``ops``: the per-sequence decode ops (default :func:`decode_ops` for the model's device,
    dtype and head size). ``capture_after``: consecutive steps of one set before it is
    captured; ``max_graphs``: graphs kept; ``kernels``: the kernel options the default ops follow. Attributes ``n_graphs``, ``captures`` (count so
    far), ``ops``, ``use_graphs``.
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
        self.capture_after, self.max_graphs = max(1, int(capture_after)), max(1, int(max_graphs))
        self._tables = model.rotary.get(0, self.max_tokens, self.device, self.dtype)  # built before any capture
        # key -> (graph, tokens, pos, logits, states): the states kept alive keep their ids unique
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
        key = (tuple(id(s) for s in states), span)
        self._streak = self._streak + 1 if key == self._last_key else 1
        self._last_key = key
        pinned = self.device.type == "cuda"
        if isinstance(token_ids, torch.Tensor):
            host = torch.tensor(positions, dtype=torch.long, pin_memory=pinned)
            tokens_in, pos_in = token_ids, host
        else:
            host = torch.tensor([list(token_ids), positions], dtype=torch.long, pin_memory=pinned)
            tokens_in, pos_in = host[0], host[1]
        entry = self._graphs.get(key)
        if entry is None and self.use_graphs and self._streak >= self.capture_after:
            entry = self._capture(key, states, span, tokens_in, pos_in)
        if entry is None:
            tokens = tokens_in.to(self.device, non_blocking=True)
            pos = pos_in.to(self.device, non_blocking=True)
            return batch_decode_step(self.model, tokens, pos, states, span, self.ops)
        self._graphs.move_to_end(key)
        graph, tokens, pos, logits, _states = entry
        tokens.copy_(tokens_in, non_blocking=True)
        pos.copy_(pos_in, non_blocking=True)
        graph.replay()
        return logits

    def _zero_unused(self, states) -> None:
        """The torch ops read ``span`` rows and mask the ones past each position: keep those
        rows finite (zeroed once per state; later writes are finite values)."""
        for state in states:
            if state not in self._finite:
                state.cache.data[:, :, :, state.n_past:].zero_()
                self._finite.add(state)

    def _capture(self, key, states, span: int, tokens_in: torch.Tensor, pos_in: torch.Tensor):
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels), put back what the
        warm-up changed (recurrent states; the KV rows it wrote are written again identically
        by the replay that follows), then capture. A failure is logged and the set runs
        eagerly (None)."""
        tokens = tokens_in.to(self.device, copy=True)
        pos = pos_in.to(self.device, copy=True)
        saved = [s.export_recurrent() if hasattr(s, "export_recurrent") else None for s in states]
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                batch_decode_step(self.model, tokens, pos, states, span, self.ops)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for state, payload in zip(states, saved):
                if payload is not None:
                    state.import_recurrent(payload, state.n_past)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph, logits = capture_graph(lambda: batch_decode_step(self.model, tokens, pos, states, span, self.ops),
                                          self.device, self._pool)
        except Exception:  # noqa: BLE001 - any capture trouble: this set decodes eagerly
            log.exception("batched decode graph capture failed for %d slots; eager", len(states))
            for state, payload in zip(states, saved):
                if payload is not None:
                    state.import_recurrent(payload, state.n_past)
            self.use_graphs = False
            return None
        self.captures += 1
        self._graphs[key] = (graph, tokens, pos, logits, tuple(states))
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return self._graphs[key]

    def forget(self, state) -> None:
        """Drop the graphs that hold ``state`` (call before the state is freed)."""
        for key in [k for k in self._graphs if id(state) in k[0]]:
            del self._graphs[key]
        self._finite.discard(state)
