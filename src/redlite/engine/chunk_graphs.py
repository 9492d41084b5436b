"""CUDA-graph replay of short prefills (:func:`redlite.models.chunk_step.chunk_prefill_step`):
the new tail of a turn (a second turn's user message, a tool result) fed in one captured
graph instead of an eager forward pass whose kernel launches cost more than the GPU's work
(bench/results/serve_gpu-*).

One graph per chunk length in :data:`BUCKETS` (and per span bucket with the torch ops); a
prefill of ``n`` tokens replays the smallest length ``T >= n``, its tokens padded with id 0.
The padded rows write keys/values at ``n_past + n .. n_past + T - 1``, past the tokens held,
which nothing reads (rows past ``n_past`` are free space; a prefill that would pad past the
cache is left to the eager path). Static inputs: one int64 device tensor holding the tokens,
the first position and the row whose logits are returned, refilled from pinned host memory
before each replay (the host does not wait for the device).

The graphs read the same state tensors, weights and rotary tables as the decoder's
(:class:`~redlite.engine.cuda_graphs.GraphDecoder`), whose ops, spans and graph memory pool
they share; none of those is ever reallocated.
"""

from __future__ import annotations

import bisect
import logging
from typing import Sequence

import torch

from redlite.engine.cuda_graphs import choose_span
from redlite.engine.graph_capture import capture_graph
from redlite.models.chunk_step import chunk_prefill_step

log = logging.getLogger("redlite.chunk_graphs")

#: chunk lengths captured (a prefill of 2..64 tokens pads to the next one)
BUCKETS = (4, 8, 16, 32, 64)


class ChunkGraphs:
    """Short prefills of ``decoder``'s model and state through captured graphs (eager with the
    same step where ``decoder.use_graphs`` is False). Attributes: ``buckets`` (ascending chunk
    lengths), ``n_graphs``."""

    def __init__(self, decoder, buckets: Sequence[int] = BUCKETS):
        self.decoder = decoder
        self.model, self.state = decoder.model, decoder.state
        self.buckets = sorted(int(b) for b in buckets)
        longest = self.buckets[-1]
        self.io = torch.zeros(longest + 2, dtype=torch.long, device=decoder.device)
        self._tokens, self._pos, self._last = self.io[:longest], self.io[longest:longest + 1], self.io[longest + 1:]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def fits(self, n_tokens: int) -> bool:
        """Whether a prefill of ``n_tokens`` (>= 2) after the held ones runs here: at most the
        longest bucket, and its padded chunk inside the cache."""
        if not 2 <= n_tokens <= self.buckets[-1]:
            return False
        return self.state.n_past + self._bucket(n_tokens) <= self.state.max_tokens

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed ``token_ids`` (checked by the caller: :meth:`fits`, ids in range) at the
        state's ``n_past``; the caller advances ``n_past``. Returns float32 logits ``[1, vocab]``
        of the last token (with graphs: a static buffer overwritten by the next replay).
        Call under ``torch.inference_mode()``; raises what capture raises."""
        n = len(token_ids)
        chunk = self._bucket(n)
        pos = int(self.state.n_past)
        longest = self.buckets[-1]
        values = list(token_ids) + [0] * (longest - n) + [pos, n - 1]
        # from pinned memory without waiting: a pageable copy would wait for the queued work
        host = torch.tensor(values, dtype=torch.long, pin_memory=self.io.is_cuda)
        self.io.copy_(host, non_blocking=True)
        span = choose_span(pos + chunk, self.decoder.spans)
        if not self.decoder.use_graphs:
            return self._body(chunk, span)
        entry = self._graphs.get((chunk, span)) or self._capture(chunk, span)
        entry[0].replay()
        return entry[1]

    def capture_all(self) -> int:
        """Capture every chunk length's graph now at the state's ``n_past`` (span buckets
        that hold it; the cache rows written past ``n_past`` are free space). Returns the
        graphs captured; 0 without graphs or when the longest chunk does not fit."""
        if not self.decoder.use_graphs or not self.fits(self.buckets[-1]):
            return 0
        before = len(self._graphs)
        pos = int(self.state.n_past)
        self._pos.fill_(pos)
        self._last.fill_(0)
        for chunk in self.buckets:
            span = choose_span(pos + chunk, self.decoder.spans)
            if (chunk, span) not in self._graphs:
                self._capture(chunk, span)
        return len(self._graphs) - before

    def _bucket(self, n_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n_tokens)]

    def _body(self, chunk: int, span: int) -> torch.Tensor:
        return chunk_prefill_step(self.model, self._tokens[:chunk], self._pos, self._last, self.state, span,
                                  self.decoder.ops)

    def _capture(self, chunk: int, span: int):
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels; it writes the rows
        the replay that follows writes again; recurrent states it moved are put back), then
        capture into the decoder's pool."""
        device = self.decoder.device
        export = getattr(self.state, "export_recurrent", None)
        saved = export() if export is not None else None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._body(chunk, span)
        torch.cuda.current_stream(device).wait_stream(stream)
        if saved is not None:
            self.state.import_recurrent(saved, self.state.n_past)
        if self.decoder._pool is None:
            self.decoder._pool = torch.cuda.graph_pool_handle()
        graph, out = capture_graph(lambda: self._body(chunk, span), device, self.decoder._pool)
        self._graphs[(chunk, span)] = (graph, out)
        log.debug("captured the %d-token prefill graph (span %d)", chunk, span)
        return graph, out
