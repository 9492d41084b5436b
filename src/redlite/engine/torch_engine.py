"""The PyTorch engine: one sequence of a :class:`~redlite.models.base.CausalLM` with a
preallocated state (see :mod:`redlite.engine.base` for the contract)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from redlite.core.session_entries import engine_dtype
from redlite.engine.base import Engine, EngineError, SamplingParams, StateSnapshot
from redlite.engine.fingerprint import weights_fingerprint
from redlite.engine.heap import reuse_freed_memory
from redlite.engine.kernel_options import KernelOptions
from redlite.engine.kv_dtype import kv_cache_dtype
from redlite.engine.sampling import TorchSampler
from redlite.engine.torch_checkpoints import TorchCheckpoints
from redlite.engine.torch_graphs import TorchGraphs
from redlite.engine.torch_ranges import TorchRanges
from redlite.kernels import native

CPU_MAX_CONTEXT = 8192


class TorchEngine(TorchGraphs, TorchRanges, TorchCheckpoints, Engine):
    """Serves one sequence of ``model`` (a ``CausalLM``) on ``device`` in ``dtype``.

    ``ctx_size``: capacity in tokens (default: the model's ``max_position_embeddings``,
    capped at 8192 on CPU). ``prefill_chunk``: the most tokens fed in one forward pass
    (bounds activation memory for long prompts; default 2048 on CPU, 8192 on CUDA). Logits
    are float32 ``[vocab]`` tensors on ``device``. ``can_rewind`` follows the model state
    (True for KV-cache-only models).

    ``cuda_graphs``: decode through :class:`~redlite.engine.cuda_graphs.GraphDecoder` (one
    captured graph replayed per token). None (default) enables it on CUDA for models with a
    ``decode_step`` and a state with a KV cache (the Llama family and the Qwen3.5 hybrid)
    unless ``kernels.cuda_graphs`` is False; True on CPU runs the same step eagerly (tests).
    ``kernels``: :class:`~redlite.engine.kernel_options.KernelOptions` (None: defaults), also
    what the decode step's ops are chosen by, and the KV cache's dtype ``kv_dtype``
    (:func:`~redlite.engine.kv_dtype.kv_cache_dtype`).
    ``decode_path`` names the path in use. On CPU, a model that decodes through the fused C step
    gives the threads to the kernels' pool: torch's own ops run on one thread outside prefill
    (:func:`redlite.kernels.native.claim_threads`).

    A pool of sequence slots (:meth:`new_slot`, :meth:`decode_batch`; see
    :mod:`redlite.engine.slot_pool`): every slot shares ``model`` and owns a whole state of
    ``ctx_size`` tokens, so ``--ctx-size`` is the context of each conversation (not split by
    ``--parallel`` as llama.cpp does) and the KV memory of N slots is N times one's.

    Token ranges: :class:`~redlite.engine.torch_ranges.TorchRanges`; checkpoints:
    :class:`~redlite.engine.torch_checkpoints.TorchCheckpoints`; graph decoding:
    :class:`~redlite.engine.torch_graphs.TorchGraphs`.
    """

    def __init__(self, model, *, model_id: str = "model", ctx_size: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 prefill_chunk: int | None = None, cuda_graphs: bool | None = None,
                 kernels: KernelOptions | None = None):
        params = next(model.parameters())
        self.model = model
        self.device = torch.device(device) if device is not None else params.device
        self.dtype = dtype or params.dtype
        self.model_id = model_id
        limit = int(model.max_position_embeddings)
        if ctx_size is None:
            ctx_size = min(limit, CPU_MAX_CONTEXT) if self.device.type == "cpu" else limit
        if ctx_size < 1:
            raise EngineError(f"ctx_size must be >= 1, got {ctx_size}")
        self.max_context = int(ctx_size)
        self.vocab_size = int(model.vocab_size)
        if prefill_chunk is None:
            prefill_chunk = 2048 if self.device.type == "cpu" else 8192
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.kernels = kernels or KernelOptions()
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and self.kernels.cuda_graphs
        graphs = bool(cuda_graphs and hasattr(model, "decode_step"))
        self.kv_dtype = kv_cache_dtype(self.kernels.kv_dtype, model, self.device, self.dtype, graphs)
        extra = {} if self.kv_dtype == self.dtype else {"kv_dtype": self.kv_dtype}
        self.state = model.new_state(self.max_context, self.device, self.dtype, **extra)
        self.can_rewind = bool(self.state.can_truncate)
        self._token = torch.zeros(1, dtype=torch.long, device=self.device)
        self._shared: dict[str, Any] = {"fingerprint": None}  # one per pool: every slot's model
        self._use_graphs = graphs and hasattr(self.state, "cache")
        self.device_resident = self.launches_async = self.device.type != "cpu"
        self._graph_decoder = None
        self._chunk_graphs = None
        if self.device.type == "cpu" and self.kernels.heap_reuse:
            reuse_freed_memory()
        if self.device.type == "cpu" and hasattr(model, "_fused") and model._fused() is not None:
            native.claim_threads()  # before any sampling (see claim_threads)

    @classmethod
    def from_pretrained(cls, path: str | Path, ctx_size: int | None = None,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                        model_id: str | None = None, **kwargs: Any) -> "TorchEngine":
        """Load a Hugging Face directory (``config.json`` + safetensors) into an engine.
        ``model_id`` defaults to the directory name. Raises what
        :func:`redlite.loading.hf.load_hf_model` raises."""
        from redlite.loading.hf import load_hf_model

        model, _config = load_hf_model(path, device, dtype, kernels=kwargs.get("kernels"))
        return cls(model, model_id=model_id or Path(path).name, ctx_size=ctx_size,
                   device=device, dtype=dtype, **kwargs)

    @property
    def n_past(self) -> int:
        return self.state.n_past

    def reset(self) -> None:
        self.state.reset()

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed ``token_ids`` after the held tokens; return float32 logits ``[vocab]`` of the
        last position. Raises ``EngineError`` for no tokens, an id out of range, or when
        ``n_past + len(token_ids) > max_context`` (state unchanged)."""
        n_new = len(token_ids)
        if n_new == 0:
            raise EngineError("prefill needs at least one token")
        if self.n_past + n_new > self.max_context:
            raise EngineError(f"context overflow: {self.n_past} held + {n_new} new tokens > "
                              f"ctx_size {self.max_context}")
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise EngineError(f"token id out of range [0, {self.vocab_size})")
        if self._use_graphs and n_new >= 2 and (logits := self._chunk_prefill(token_ids)) is not None:
            return logits
        done = 0
        if self._use_graphs and n_new <= self.graph_prefill_tokens:
            with torch.inference_mode():
                while done < n_new and (logits := self._graph_step(int(token_ids[done]))) is not None:
                    self.state.n_past += 1
                    done += 1
            if done == n_new:
                return logits[0].clone()
        ids = ids[done:].to(self.device)
        with torch.inference_mode(), native.torch_threads():
            for begin in range(0, n_new - done, self.prefill_chunk):
                logits = self.model(ids[begin:begin + self.prefill_chunk], self.state)
        return logits[0].clone()  # a normal tensor (not an inference one): callers may edit it

    def decode(self, token_id: int) -> torch.Tensor:
        """Feed one token; return float32 logits ``[vocab]`` of the next position.
        Raises ``EngineError`` on context overflow or an id out of range."""
        if self.n_past >= self.max_context:
            raise EngineError(f"context overflow: ctx_size {self.max_context} tokens held")
        if not 0 <= token_id < self.vocab_size:
            raise EngineError(f"token id {token_id} out of range [0, {self.vocab_size})")
        if self._use_graphs:
            with torch.inference_mode():
                logits = self._graph_step(token_id)
            if logits is not None:
                self.state.n_past += 1
                return logits[0].clone()
        with torch.inference_mode():
            self._token.fill_(token_id)
            logits = self.model(self._token, self.state)
        return logits[0].clone()

    def new_slot(self) -> "TorchEngine":
        """Another slot of this pool (see :meth:`Engine.new_slot` and
        :func:`redlite.engine.slot_pool.new_slot`: memory and options)."""
        from redlite.engine.slot_pool import new_slot

        return new_slot(self)

    def decode_batch(self, slots: Sequence[Engine], token_ids: Sequence[int]) -> list[torch.Tensor]:
        """One forward over the slots (:meth:`Engine.decode_batch`,
        :func:`redlite.engine.slot_pool.decode_batch`): float32 ``[vocab]`` logits per slot."""
        from redlite.engine.slot_pool import decode_batch

        return decode_batch(self, slots, token_ids)

    def copy_prefix(self, source: Engine, n_tokens: int) -> None:
        """:meth:`Engine.copy_prefix` (:func:`redlite.engine.slot_pool.copy_prefix`)."""
        from redlite.engine.slot_pool import copy_prefix

        copy_prefix(self, source, n_tokens)

    def greedy_batch(self, rows: Sequence[torch.Tensor]) -> list[int]:
        """One argmax over the stacked rows and one read back (the first index of the largest
        value, as the greedy sampler picks)."""
        if len(rows) < 2:
            return super().greedy_batch(rows)
        with torch.inference_mode():
            return torch.stack(list(rows)).argmax(dim=-1).tolist()

    def greedy_batch_async(self, slots: Sequence[Engine], rows: Sequence[torch.Tensor]):
        """:meth:`Engine.greedy_batch_async` (:func:`redlite.engine.slot_pool.greedy_batch_async`:
        on CUDA nothing waits for the step)."""
        from redlite.engine.slot_pool import greedy_batch_async

        return greedy_batch_async(self, slots, rows)

    def rewind(self, n_tokens: int) -> None:
        if not self.can_rewind:
            raise EngineError(f"{type(self.model).__name__} state cannot rewind")
        if not 0 <= n_tokens <= self.n_past:
            raise EngineError(f"cannot rewind {self.n_past} tokens to {n_tokens}")
        self.state.truncate(n_tokens)

    def make_sampler(self, params: SamplingParams, prompt_ids: Sequence[int] = (),
                     constraint: Any = None) -> TorchSampler:
        return TorchSampler(params, self.device, prompt_ids, constraint)

    def snapshot(self) -> StateSnapshot:
        """CPU copy of the held state (``tensor_format="torch"``); ``meta`` names the model
        fingerprint, dtype and the state's layout."""
        with torch.no_grad():  # normal tensors, which callers may edit or save
            tensors = self.state.export()
        meta = {"fingerprint": self.fingerprint(), "dtype": engine_dtype(self),
                "layout": type(self.state).__name__}
        return StateSnapshot(n_past=self.n_past, tensors=tensors, meta=meta, tensor_format="torch")

    def restore(self, snapshot: StateSnapshot) -> None:
        """Replace the held state by ``snapshot``. Raises ``EngineError`` when it was taken
        from another model, does not fit ``max_context``, or its tensors do not match."""
        found = snapshot.meta.get("fingerprint")
        if found is not None and found != self.fingerprint():
            raise EngineError("snapshot was taken from another model")
        if snapshot.tensor_format != "torch":
            raise EngineError(f"cannot restore a {snapshot.tensor_format!r} snapshot")
        if not 0 <= snapshot.n_past <= self.max_context:
            raise EngineError(f"snapshot of {snapshot.n_past} tokens exceeds ctx_size {self.max_context}")
        try:
            with torch.inference_mode():
                self.state.load(snapshot.tensors, snapshot.n_past)
        except EngineError:
            self.reset()
            raise

    def restore_targets(self, n_past: int) -> dict[str, torch.Tensor] | None:
        """See :meth:`Engine.restore_targets`: CPU engines whose state has ``load_targets``
        (views of the KV cache); None on other devices (reading goes through host memory
        there anyway) and for ``n_past`` beyond ``max_context``."""
        if self.device.type != "cpu" or not hasattr(self.state, "load_targets") \
                or not 0 <= n_past <= self.max_context:
            return None
        return self.state.load_targets(int(n_past))

    def state_nbytes(self) -> int:
        return int(self.state.nbytes())

    def fingerprint(self) -> str:
        """A digest of the config, dtype and every byte of every weight
        (:func:`redlite.engine.fingerprint.weights_fingerprint`), computed once."""
        if self._shared["fingerprint"] is None:
            self._shared["fingerprint"] = weights_fingerprint(self.model.config, self.dtype,
                                                              self.model.state_dict().items())
        return self._shared["fingerprint"]
