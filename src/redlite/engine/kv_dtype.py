"""Which dtype a torch engine's KV cache holds (``--kv-dtype``, :class:`KernelOptions.kv_dtype
<redlite.engine.kernel_options.KernelOptions>`).

A float16 cache under float32 weights halves the cache's memory (and the RAM and disk a parked
conversation takes) and what every decode token reads from it; it does not make decode faster
where the widening of its rows costs what the halved read saves (``bench/results/``). Keys and
values are computed in float32 and rounded to nearest-even as they are written; every path
(prefill, the fused C decode step, a batch of them, restores from RAM or disk) reads the same
rounded values, so a warm continuation still equals a cold one. Against a float32 cache the
logits move enough to flip a greedy near-tie, so float16 is a choice, not the default.
"""

from __future__ import annotations

import torch

from redlite.engine.kernel_options import KV_DTYPES


def kv_cache_dtype(requested: str, model, device: torch.device, dtype: torch.dtype,
                   graphs: bool) -> torch.dtype:
    """The cache dtype of an engine of ``model`` on ``device`` computing in ``dtype``:
    ``auto`` and an explicit ``dtype`` give ``dtype``; ``float16`` under float32 weights only
    where the model decodes through the fused C step on CPU (a Llama-family GGUF model with
    quantized weights: :class:`~redlite.layers.cpu_decode.FusedDecode` reads and writes it).
    ``graphs``: the engine decodes through its graph step (torch ops that read a cache of the
    model's dtype only). Raises ValueError for a choice this model cannot use (``serve`` then
    exits with that line, as for an unsupported model)."""
    if requested not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {requested!r}")
    if requested == "auto" or getattr(torch, requested) == dtype:
        return dtype
    if (requested == "float16" and device.type == "cpu" and dtype == torch.float32 and not graphs
            and hasattr(model, "_fused") and model._fused() is not None):
        return torch.float16
    name = str(dtype).removeprefix("torch.")
    why = ("a float16 cache under float32 weights needs the fused CPU decode step of a "
           "Llama-family GGUF model" if requested == "float16" and dtype == torch.float32
           else "a cache of another dtype than the weights' is float16 under float32 weights on CPU only")
    raise ValueError(f"--kv-dtype {requested}: this model's cache can only hold {name} here ({why})")
