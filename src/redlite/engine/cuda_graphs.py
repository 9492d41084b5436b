"""CUDA-graph replay of the one-token decode step of a KV-cache model.

A model that provides ``decode_step(token, pos, state, span, ops)`` (see
:meth:`redlite.models.llama.LlamaModel.decode_step`) is captured once per "span" in a CUDA
graph whose inputs are two static device tensors, the token id and its position. A decode
then costs two tiny fill kernels and one graph launch: no Python per layer, no launch gaps
per kernel, and no host-device synchronisation (the caller's sampling reads the id).

Spans: with :class:`~redlite.layers.triton_ops.TritonDecodeOps` (CUDA + Triton) attention
reads the key count from the position tensor, so a single graph (span = the cache size)
serves every position. With the torch ops, attention reads ``span`` cache rows and masks
the ones past the position, so graphs are captured lazily per bucket of :func:`bucket_spans`
(powers of two from 1024, then the cache size) and a decode uses the smallest bucket that
covers its position (:func:`choose_span`).

Modes: a graph either returns the logits (the host samples: :meth:`GraphDecoder.step`) or
also samples the next token on the device into the token tensor it reads
(:mod:`redlite.engine.device_sampling`), so the next step can be launched before the host has
read the id (:meth:`GraphDecoder.step_ahead`; :mod:`redlite.engine.token_stream` runs that
loop). States that cannot rewind (recurrent layers) copy their recurrent part aside at the
start of such a step, so the step can be undone (:meth:`GraphDecoder.undo`).

The graphs hold pointers into the state's own cache tensor (and, for the Qwen3.5 hybrid
family, its conv and recurrent state tensors), the model's weights and the rotary tables,
none of which is ever reallocated: rewind, reset, restore and checkpoint restores only move
``n_past`` or copy into those tensors, so the graphs stay valid. On a CPU device the same
step runs eagerly (for tests).
"""

from __future__ import annotations

import bisect
import logging

import torch

from redlite.engine.device_sampling import GREEDY, SAMPLE, DeviceSampling, sample_into
from redlite.engine.graph_capture import capture_graph
from redlite.engine.kernel_options import KernelOptions
from redlite.layers.decode_ops import TorchDecodeOps, decode_ops

LOGITS = "logits"  # the graph mode whose step returns logits (the host samples)
MODES = (LOGITS, GREEDY, SAMPLE)

log = logging.getLogger("redlite.cuda_graphs")


def bucket_spans(max_tokens: int, first: int = 1024) -> list[int]:
    """Ascending spans: ``first, 2*first, ...`` below ``max_tokens``, then ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    spans, span = [], max(1, int(first))
    while span < max_tokens:
        spans.append(span)
        span *= 2
    return spans + [int(max_tokens)]


def choose_span(n_tokens: int, spans: list[int]) -> int:
    """The smallest span in the ascending ``spans`` that holds ``n_tokens`` (>= 1) rows.
    Raises ``ValueError`` when none does."""
    i = bisect.bisect_left(spans, n_tokens)
    if n_tokens < 1 or i == len(spans):
        raise ValueError(f"no span holds {n_tokens} tokens (spans {spans})")
    return spans[i]


class GraphDecoder:
    """Decodes one token at a time on ``model`` + ``state`` (a state whose KV cache is
    ``state.cache``; a state with recurrent parts provides ``export_recurrent`` /
    ``import_recurrent``, used to undo the capture's warm-up step) through captured CUDA
    graphs.

    ``use_graphs``: None captures graphs on CUDA and runs eagerly elsewhere. ``ops``: the
    decode ops (default: :func:`~redlite.layers.decode_ops.decode_ops` for the cache's
    device, dtype and head size, with ``kernels``' Triton, PDL and GEMV settings). Attributes: ``spans`` (ascending ints), ``ops``,
    ``use_graphs``, ``n_graphs`` (graphs captured so far), ``token`` (int64 [1] device
    tensor: the id the next step feeds), ``sampling`` (the device sampling settings).
    """

    def __init__(self, model, state, use_graphs: bool | None = None, ops: TorchDecodeOps | None = None,
                 kernels: KernelOptions | None = None):
        cache = state.cache.data  # [n_layers, 2, n_kv_heads, max_tokens, head_dim]
        self.model, self.state = model, state
        self.device, self.dtype = cache.device, cache.dtype
        kernels = kernels or KernelOptions()
        self.ops = ops or decode_ops(self.device, self.dtype, cache.shape[-1], cache.shape[2], model.linear,
                                     triton=kernels.triton, pdl=kernels.pdl,
                                     gemv_configs=kernels.gemv_configs)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        max_tokens = state.max_tokens
        self.spans = [max_tokens] if self.ops.length_from_pos else bucket_spans(max_tokens)
        if not self.ops.length_from_pos:
            with torch.no_grad():  # masked rows still enter the products: keep them finite
                cache[:, :, :, state.n_past:].zero_()
        self.token = torch.zeros(1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.sampling = DeviceSampling(self.device, model.vocab_size)
        # recurrent states (no rewind): a copy taken at the start of each step_ahead, for undo
        self._backup = state.export_recurrent() if hasattr(state, "save_recurrent") else None
        # Build the rotary tables for every position now (no rebuild during a capture) and
        # keep them referenced, since graphs hold raw pointers.
        self._tables = model.rotary.get(0, max_tokens, self.device, self.dtype)
        self._graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._eager_sampling: set[str] = set()  # sampling modes whose capture failed

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def step(self, token_id: int, position: int) -> torch.Tensor:
        """Feed ``token_id`` at ``position`` (the state's ``n_past``; the caller advances it).
        Returns float32 logits ``[1, vocab]``: with graphs, a static buffer overwritten by
        the next step (copy it to keep it). Raises ``ValueError`` when ``position`` is
        outside the cache. Call under ``torch.inference_mode()``."""
        self.token.fill_(int(token_id))
        return self._run(position, LOGITS)

    def step_ahead(self, position: int, mode: str) -> None:
        """Feed the id in :attr:`token` at ``position`` and sample the next one into
        :attr:`token` on the device (``mode``: ``greedy`` or ``sample``, settings in
        :attr:`sampling`). Nothing is read on the host. Raises ``ValueError`` as :meth:`step`.
        Call under ``torch.inference_mode()``."""
        if mode not in (GREEDY, SAMPLE):
            raise ValueError(f"unknown sampling mode {mode!r}")
        self._run(position, mode)

    def sample_first(self, logits: torch.Tensor, mode: str) -> None:
        """Sample from ``logits`` (float32 [vocab], e.g. a prefill's) into :attr:`token`."""
        sample_into(logits, self.token, mode, self.sampling)

    def undo(self, position: int) -> None:
        """Put back the recurrent part saved by the last :meth:`step_ahead` and set the
        state's ``n_past`` to ``position`` (where that step fed its token). KV-only states
        just move ``n_past``: the row written past it is ignored."""
        if self._backup is not None:
            self.state.import_recurrent(self._backup, position)
        else:
            self.state.truncate(position)

    def capture_all(self, modes=MODES) -> int:
        """Capture every span's step in every mode now (nothing without graphs), warming up at
        the state's current ``n_past`` (< max_tokens; small, so every span covers it); the
        state and :attr:`token` are as before afterwards. Returns the graphs captured."""
        if not self.use_graphs:
            return 0
        before = len(self._graphs)
        self.pos.fill_(int(self.state.n_past))
        for span in self.spans:
            for mode in modes:
                if (span, mode) not in self._graphs and mode not in self._eager_sampling:
                    self._capture_or_fall_back(span, mode)
        return len(self._graphs) - before

    def _run(self, position: int, mode: str):
        if not 0 <= position < self.state.max_tokens:
            raise ValueError(f"position {position} outside the cache of {self.state.max_tokens}")
        span = choose_span(position + 1, self.spans)
        self.pos.fill_(int(position))
        if not self.use_graphs:
            return self._body(span, mode)
        if mode not in self._eager_sampling:
            out = self._replay(span, mode)
            if out is not None:
                return out
        # a sampling mode that cannot be captured: the logits graph, then sample eagerly
        if self._backup is not None:
            self.state.save_recurrent(self._backup)
        logits = self._replay(span, LOGITS)
        sample_into(logits, self.token, mode, self.sampling)
        return logits

    def _replay(self, span: int, mode: str) -> torch.Tensor | None:
        """Replay ``(span, mode)``'s graph (captured first if needed); None when the mode
        just failed to capture."""
        entry = self._graphs.get((span, mode))
        if entry is None:
            entry = self._capture_or_fall_back(span, mode)
            if entry is None:
                return None
        entry[0].replay()
        return entry[1]

    def _capture_or_fall_back(self, span: int, mode: str):
        """Capture ``(span, mode)``; when a sampling mode cannot be captured (a kernel that
        refuses capture), log it and from then on sample that mode eagerly after the logits
        graph (returns None). Logits-mode failures raise."""
        try:
            return self._capture(span, mode)
        except Exception:
            if mode == LOGITS:
                raise
            log.exception("sampling mode %s cannot be captured; sampling it after the graph", mode)
            self._eager_sampling.add(mode)
            return None

    def _body(self, span: int, mode: str) -> torch.Tensor:
        """The step's work (what a graph captures): [save the recurrent part,] decode,
        [sample into ``token``]."""
        if mode != LOGITS and self._backup is not None:
            self.state.save_recurrent(self._backup)
        logits = self.model.decode_step(self.token, self.pos, self.state, span, self.ops)
        if mode != LOGITS:
            sample_into(logits, self.token, mode, self.sampling)
        return logits

    def _capture(self, span: int, mode: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (compiles Triton kernels, picks cuBLAS kernels) then capture the step for
        ``span`` and ``mode``. The warm-up writes the current token's keys/values at the
        current position, which the replay that follows writes again identically; what else
        it changes (recurrent states, the token, the random counter) is put back first."""
        saved = self.state.export_recurrent() if hasattr(self.state, "export_recurrent") else None
        token, counter = self.token.clone(), self.sampling.ints.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._body(span, mode)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if saved is not None:
            self.state.import_recurrent(saved, self.state.n_past)
        self.token.copy_(token)
        self.sampling.ints.copy_(counter)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, out = capture_graph(lambda: self._body(span, mode), self.device, self._pool)
        self._graphs[(span, mode)] = (graph, out)
        return graph, out
