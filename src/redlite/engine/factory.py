"""Builds the torch engine and its tokenizer from a model path (the CLI's ``--model``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("redlite.engine")

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def default_device() -> str:
    """``cuda`` when a CUDA device is usable, else ``cpu``."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_engine(model: str | None, ctx_size: int | None = None, device: str | None = None,
                dtype: str | None = None, kernels=None, cache_dir: str | None = None):
    """(TorchEngine, HFTokenizer) for ``model``: a GGUF file (converted once into a cached
    Hugging Face directory under ``cache_dir``, default ``~/.cache/redlite``) or a Hugging Face
    directory; None means the bundled SmolLM2-135M-Instruct. dtype: float32 on CPU and
    bfloat16 on CUDA unless given. ``kernels``: the engine's
    :class:`~redlite.engine.kernel_options.KernelOptions` (None: defaults).
    Raises FileNotFoundError for a missing path, ValueError for an unsupported architecture."""
    import torch

    from redlite.engine.heap import release_free_heap
    from redlite.engine.torch_engine import TorchEngine
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer

    torch.set_grad_enabled(False)
    source = Path(model) if model else bundled_model_path()
    started = time.perf_counter()
    model_dir = resolve_model_dir(source, cache_dir)
    device = device or default_device()
    torch_dtype = getattr(torch, dtype) if dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    model_id = source.stem if source.is_file() else source.name
    engine = TorchEngine.from_pretrained(model_dir, ctx_size=ctx_size, device=device,
                                         dtype=torch_dtype, model_id=model_id, kernels=kernels)
    tokenizer = load_tokenizer(model_dir)
    quantized = {id(m): m for m in engine.model.modules() if getattr(m, "is_quantized", False)}
    parameters = (sum(p.numel() for p in engine.model.parameters())
                  + sum(m.shape[0] * m.shape[1] for m in quantized.values()))
    trimmed = release_free_heap()
    log.info("model %s: %.1fM parameters, context %d tokens, device %s, dtype %s, KV cache %s "
             "(%.0f MB at full context), loaded in %.2f s (from %s)", model_id, parameters / 1e6,
             engine.max_context, device, str(torch_dtype).removeprefix("torch."),
             str(engine.kv_dtype).removeprefix("torch."), engine.state.cache.nbytes(engine.max_context) / 1e6
             if hasattr(engine.state, "cache") else 0.0, time.perf_counter() - started, source)
    log.debug("returned the free heap to the system after loading: %s", "yes" if trimmed else "not on this libc")
    return engine, tokenizer
