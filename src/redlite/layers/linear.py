"""The dense ``y = x @ W.T + b`` used by every layer, with a faster CPU kernel.

On CPU, ``F.linear`` goes to MKL, whose matrix-vector path (decode) is far from memory
bandwidth on some CPUs (about 2x slower than oneDNN on AMD Zen 4); oneDNN's linear op,
``torch.ops.mkldnn._linear_pointwise``, reads the same ``[out, in]`` weight and is as fast or
faster for every shape measured, prefill included. It is an internal op of torch, so
:func:`linear_kernel` probes it once per dtype (present, same result as ``F.linear``) and
falls back to ``F.linear`` otherwise. ``REDLITE_ONEDNN=0`` disables it.

:class:`Linear` is the layer object built on it: dense, or quantized (GGUF 4-bit formats on
CPU, see :mod:`redlite.layers.quant_int4`), chosen at load from what the weights are.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from redlite.layers import quant_int4

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


class Linear(nn.Module):
    """``y = x @ W.T + b`` owning its weight's format and kernels, so model code only calls
    ``linear(x)`` (and ``linear.rows(ids)`` for an embedding table).

    Built dense and uninitialised (``weight`` [out, in] in ``dtype``, ``bias`` [out] or None),
    then filled by :meth:`load` from row blocks stacked in order (e.g. q, k, v), each either a
    tensor or a quantized tensor (an object with ``qtype``, ``shape``, ``dequantize()`` ->
    float32 numpy ``[rows, cols]`` and ``int4_parts()``, as
    :class:`redlite.loading.gguf_quant.QuantizedTensor`). On CPU, when every block has a
    4-bit form and the shape suits the kernel, the weight stays quantized
    (:class:`~redlite.layers.quant_int4.Int4Weight`; ``weight`` becomes None and ``quant``
    holds it); otherwise blocks are dequantized into the dense weight (``format`` says which).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.kernel = linear_kernel(device, dtype)
        self.dtype = self.weight.dtype
        self.quant = None
        self.format = "dense"

    def load(self, blocks: list, bias_blocks: list | None = None) -> None:
        """Fill the weight from row blocks (see the class docstring; their rows must add up to
        ``out_features``) and the bias from ``bias_blocks`` (tensors) when the layer has one."""
        device, dtype = self.weight.device, self.weight.dtype
        quantized = [b for b in blocks if hasattr(b, "int4_parts")]
        kinds = sorted({b.qtype for b in quantized})
        if quantized and device.type == "cpu" and quant_int4.supported(self.out_features, self.in_features):
            parts = [b.int4_parts() if hasattr(b, "int4_parts") else None for b in blocks]
            if all(p is not None for p in parts):
                self.quant = quant_int4.Int4Weight.from_parts(parts)
                self.weight = None
                for name, tensor in self.quant.tensors().items():
                    self.register_buffer(f"quant_{name}", tensor)
                self.format = "+".join(kinds) + ":int4"
        if self.quant is None:
            row = 0
            for block in blocks:
                data = torch.from_numpy(block.dequantize()) if hasattr(block, "int4_parts") else block
                self.weight[row:row + data.shape[0]].copy_(data)
                row += data.shape[0]
            if row != self.out_features:
                raise ValueError(f"loaded {row} rows into a linear of {self.out_features}")
            self.format = "+".join(kinds) + ":dequantized" if kinds else "dense"
        if self.bias is not None:
            self.bias.copy_(torch.cat([b.reshape(-1) for b in bias_blocks]))

    def load_state(self, tensors: dict[str, torch.Tensor], fmt: str) -> None:
        """Restore from this layer's own ``state_dict`` entries (names without the module
        prefix) as saved after a :meth:`load`; ``fmt``: the ``format`` it had then."""
        if "quant_offset" in tensors:
            n_parts = sum(name.startswith("quant_packed") for name in tensors)
            self.quant = quant_int4.Int4Weight(
                [tensors[f"quant_packed{i}"] for i in range(n_parts)],
                [tensors[f"quant_scale{i}"] for i in range(n_parts)], tensors["quant_offset"],
                [tensors[f"quant_scale_zero{i}"] for i in range(n_parts)])
            self.weight = None
            for name, tensor in self.quant.tensors().items():
                self.register_buffer(f"quant_{name}", tensor)
        else:
            self.weight.copy_(tensors["weight"])
        if self.bias is not None:
            self.bias.copy_(tensors["bias"])
        self.format = fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] -> [T, out] in ``x``'s dtype."""
        if self.quant is None:
            return self.kernel(x, self.weight, self.bias)
        out = self.quant.linear(x, self.kernel)
        return out if self.bias is None else out.add_(self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (LongTensor [T]) of the weight, as an embedding lookup: [T, in]."""
        if self.quant is None:
            return F.embedding(ids, self.weight)
        return self.quant.rows(ids, self.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.format}"
