"""The CUDA-graph side of :class:`~redlite.engine.torch_engine.TorchEngine` (a mixin): the
graph decoder it builds on first use, capture, the fall-back to eager decode when a capture
fails, the device token stream, and the pool-wide settings the start-up warm-up measures
(``graph_prefill_tokens``, ``checkpoint_min_piece``). Expects the engine's ``model``,
``state``, ``kernels``, ``_use_graphs``, ``_graph_decoder``, ``_chunk_graphs`` (None: not
built yet; False: none) and ``_shared``."""

from __future__ import annotations

import logging

import torch

from redlite.engine.base import SamplingParams, TokenStream

log = logging.getLogger("redlite.engine")


class TorchGraphs:
    """Graph decoding of a torch engine (see the module docstring)."""

    @property
    def decode_path(self) -> str:
        """``"eager"``, or ``"graph/<ops>"`` / ``"static-eager/<ops>"`` once the graph decoder
        exists (``<ops>``: ``triton`` or ``torch``)."""
        decoder = self._graph_decoder
        if not self._use_graphs or decoder is None:
            return "eager" if not self._use_graphs else "graph (not built yet)"
        return f"{'graph' if decoder.use_graphs else 'static-eager'}/{decoder.ops.name}"

    @property
    def graph_prefill_tokens(self) -> int:
        """Prefills of at most this many tokens run token by token through the captured decode
        step (one graph replay each) instead of one eager forward pass, whose kernel launches
        cost more than that on a GPU; 0 (the default): never. Shared by the slots of a pool;
        set by the start-up warm-up from a measurement (:func:`redlite.engine.warmup.warm_up`)."""
        return self._shared.get("graph_prefill_tokens", 0)

    @graph_prefill_tokens.setter
    def graph_prefill_tokens(self, n: int) -> None:
        self._shared["graph_prefill_tokens"] = max(0, int(n))

    @property
    def checkpoint_min_piece(self) -> int:
        """The fewest tokens the generator puts between two checkpoint cuts of one prefill
        (:func:`redlite.core.checkpoints.prefill_split_points`); 0 (the default): a cut at every
        message boundary. Shared by a pool's slots; the GPU warm-up sets it
        (:data:`redlite.engine.warmup.GPU_CHECKPOINT_MIN_PIECE`)."""
        return self._shared.get("checkpoint_min_piece", 0)

    @checkpoint_min_piece.setter
    def checkpoint_min_piece(self, n: int) -> None:
        self._shared["checkpoint_min_piece"] = max(0, int(n))

    def graph_decoder(self):
        """The :class:`~redlite.engine.cuda_graphs.GraphDecoder` (built on first use), or None
        when this engine decodes eagerly (or its decoder failed to build: logged, eager from
        then on)."""
        if not self._use_graphs:
            return None
        if self._graph_decoder is None:
            from redlite.engine.cuda_graphs import GraphDecoder

            try:
                self._graph_decoder = GraphDecoder(self.model, self.state, kernels=self.kernels)
            except Exception:  # noqa: BLE001 - any trouble: the eager path serves
                self._graphs_failed("build")
        return self._graph_decoder

    def capture_graphs(self) -> int:
        """Capture every graph of the decoder now, warming up at ``n_past`` (see
        :meth:`GraphDecoder.capture_all`), and the short-prefill graphs
        (:meth:`ChunkGraphs.capture_all`); returns how many. 0 when decoding eagerly; a capture
        failure is logged and the eager path serves from then on."""
        decoder = self.graph_decoder()
        if decoder is None:
            return 0
        try:
            captured = decoder.capture_all()
        except Exception:  # noqa: BLE001 - as in _graph_step
            self._graphs_failed("capture")
            return 0
        chunks = self.chunk_graphs()
        if chunks is not None:
            try:
                captured += chunks.capture_all()
            except Exception:  # noqa: BLE001 - as in _chunk_prefill
                self._chunks_failed()
        return captured

    def chunk_graphs(self):
        """The :class:`~redlite.engine.chunk_graphs.ChunkGraphs` of this engine's decoder (built
        on first use) when the decoder serves, ``kernels.chunk_graphs`` is on and the model
        has a chunk step (:func:`~redlite.models.chunk_step.supports_chunk`); else None."""
        if self._chunk_graphs is None:
            from redlite.models.chunk_step import supports_chunk

            decoder = self.graph_decoder() if self.kernels.chunk_graphs else None
            if decoder is None or not supports_chunk(self.model):
                self._chunk_graphs = False
                return None
            from redlite.engine.chunk_graphs import BUCKETS, ChunkGraphs
            from redlite.models.chunk_step import longest_chunk

            longest = longest_chunk(self.model)
            self._chunk_graphs = ChunkGraphs(decoder, [b for b in BUCKETS if b <= longest])
        return self._chunk_graphs or None

    def _chunk_prefill(self, token_ids) -> torch.Tensor | None:
        """Logits ``[vocab]`` of a short prefill through :meth:`chunk_graphs` (``n_past``
        advanced), or None when it does not serve this prefill (nothing changed) or fails
        (logged; short prefills run eagerly from then on)."""
        chunks = self.chunk_graphs()
        if chunks is None or not chunks.fits(len(token_ids)):
            return None
        try:
            with torch.inference_mode():
                logits = chunks.prefill(token_ids)
        except Exception:  # noqa: BLE001 - any capture trouble: the eager prefill serves
            self._chunks_failed()
            return None
        self.state.n_past += len(token_ids)
        return logits[0].clone()

    def _chunks_failed(self) -> None:
        log.exception("short-prefill graphs failed; prefilling eagerly from now on")
        self._chunk_graphs = False

    def _graphs_failed(self, what: str) -> None:
        log.exception("CUDA-graph decode failed (%s); decoding eagerly from now on", what)
        self._use_graphs, self._graph_decoder, self._chunk_graphs = False, None, False

    def _graph_step(self, token_id: int) -> torch.Tensor | None:
        """Logits [1, vocab] from the graph decoder, or None after disabling it when it fails
        to build or capture (logged; the eager path then serves)."""
        decoder = self.graph_decoder()
        if decoder is None:
            return None
        try:
            return decoder.step(token_id, self.n_past)
        except Exception:  # noqa: BLE001 - any capture trouble: fall back to eager decode
            self._graphs_failed("capture")
            return None

    def token_stream(self, params: SamplingParams, logits: torch.Tensor) -> TokenStream | None:
        """A :class:`~redlite.engine.token_stream.DeviceTokenStream` (sampling inside the
        graph) when the graph decoder serves and ``params`` need no host rule
        (:func:`~redlite.engine.device_sampling.mode_of`); else None."""
        from redlite.engine.device_sampling import mode_of
        from redlite.engine.token_stream import DeviceTokenStream

        mode = mode_of(params)
        decoder = self.graph_decoder() if mode is not None else None
        if decoder is None:
            return None
        return DeviceTokenStream(self, decoder, params, mode, logits)
