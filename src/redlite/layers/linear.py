"""The dense ``y = x @ W.T + b`` used by every layer, with a faster CPU kernel.

On CPU, ``F.linear`` goes to MKL, whose matrix-vector path (decode) is far from memory
bandwidth on some CPUs (about 2x slower than oneDNN on AMD Zen 4); oneDNN's linear op,
``torch.ops.mkldnn._linear_pointwise``, reads the same ``[out, in]`` weight and is as fast or
faster for every shape measured, prefill included. It is an internal op of torch, so
:func:`linear_kernel` probes it once per dtype (present, same result as ``F.linear``) and
falls back to ``F.linear`` otherwise; ``onednn=False`` (the CLI's ``--no-onednn``) skips it.

A weight may also be a :class:`~redlite.layers.quant_weight.QuantWeight` (GGUF blocks kept
quantized): the functions of :func:`linear_kernel` and :func:`embedding` take either, and
:func:`assign_weight` puts whichever suits the loaded blocks in place, so model code never
asks which it holds. Layers take an optional ``linear`` (one of these functions, chosen once by
the model); None picks :func:`linear_kernel`'s default.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not x.is_cpu:  # a model built on the CPU, then moved (``.to("cuda")``)
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def _onednn_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
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


def linear_kernel(device: torch.device | str | None, dtype: torch.dtype | None,
                  onednn: bool = True) -> LinearFn:
    """The linear function to use for weights held on ``device`` in ``dtype``:
    ``fn(x [T, in], weight [out, in], bias [out] | None) -> [T, out]`` (2-D ``x``); ``weight``
    may be a dense tensor or a :class:`~redlite.layers.quant_weight.QuantWeight`. ``onednn``:
    False uses ``F.linear`` on CPU too."""
    device = torch.device(device if device is not None else "cpu")
    dtype = dtype or torch.get_default_dtype()
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn and _onednn_works(dtype):
        return _with_quantized(_onednn_linear)
    return _with_quantized(F.linear)


@functools.lru_cache(maxsize=None)
def _with_quantized(dense: LinearFn) -> LinearFn:
    def linear(x, weight, bias=None):
        if isinstance(weight, torch.Tensor):
            return dense(x, weight, bias)
        return weight.linear(x, bias, dense)

    return linear


def embedding(ids: torch.Tensor, weight) -> torch.Tensor:
    """Rows ``ids`` (LongTensor [T]) of an embedding table ``weight`` [vocab, hidden] (dense or
    quantized) -> [T, hidden]."""
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    return weight.rows(ids)


def assign_weight(module: torch.nn.Module, name: str, blocks: list) -> None:
    """Fill ``module.<name>`` (an uninitialised dense ``[out, in]`` parameter) from row blocks
    stacked in order (e.g. q, k, v), each a tensor or a
    :class:`~redlite.layers.quant_weight.QuantTensor`. When every block is quantized in a
    kernel format and the parameter is on CPU, the parameter is replaced by a
    :class:`~redlite.layers.quant_weight.QuantWeight` over the blocks (no copy); otherwise the
    blocks are dequantized into it (float32, then the parameter's dtype and device).

    Raises ValueError when the blocks' rows do not add up to the parameter's."""
    from redlite.layers.quant_weight import QuantTensor, QuantWeight, dequantize_block, kernel_supported

    current = getattr(module, name)
    rows = sum(int(b.shape[0]) for b in blocks)
    if rows != current.shape[0]:
        raise ValueError(f"{name}: {rows} rows for a weight of {current.shape[0]}")
    if any(isinstance(b, QuantTensor) for b in blocks) and kernel_supported(blocks, current.device):
        delattr(module, name)
        setattr(module, name, QuantWeight(blocks))
        return
    row = 0
    for block in blocks:
        data = dequantize_block(block)
        current[row:row + data.shape[0]].copy_(data)
        row += data.shape[0]
