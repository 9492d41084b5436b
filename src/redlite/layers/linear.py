"""The dense ``y = x @ W.T + b`` used by every layer, with a faster CPU kernel.

On CPU, ``F.linear`` goes to MKL, whose matrix-vector path (decode) is far from memory
bandwidth on some CPUs (about 2x slower than oneDNN on AMD Zen 4); oneDNN's linear op,
``torch.ops.mkldnn._linear_pointwise``, reads the same ``[out, in]`` weight and is as fast or
faster for every shape measured, prefill included. It is an internal op of torch, so
:func:`linear_kernel` probes it once per dtype (present, same result as ``F.linear``) and
falls back to ``F.linear`` otherwise. ``REDLITE_ONEDNN=0`` disables it.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def _onednn_works(dtype: torch.dtype) -> bool:
    if os.environ.get("REDLITE_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 40, generator=gen).to(dtype)
        w = torch.randn(24, 40, generator=gen).to(dtype)
        b = torch.randn(24, generator=gen).to(dtype)
        with torch.inference_mode():
            for bias in (None, b):
                got, want = _onednn_linear(x, w, bias), F.linear(x, w, bias)
                tol = 1e-4 if dtype == torch.float32 else 0.1
                if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                    return False
            got = _onednn_linear(x[:1], w)  # the decode shape
            return bool(torch.allclose(got.float(), F.linear(x[:1], w).float(), atol=tol, rtol=tol))
    except Exception:  # noqa: BLE001 - missing op or unsupported dtype: use F.linear
        return False


def linear_kernel(device: torch.device | str | None, dtype: torch.dtype | None) -> LinearFn:
    """The linear function to use for weights held on ``device`` in ``dtype``:
    ``fn(x [T, in], weight [out, in], bias [out] | None) -> [T, out]`` (2-D ``x``)."""
    device = torch.device(device if device is not None else "cpu")
    dtype = dtype or torch.get_default_dtype()
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _onednn_works(dtype):
        return _onednn_linear
    return F.linear
