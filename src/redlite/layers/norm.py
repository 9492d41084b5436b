"""RMSNorm over the last dimension, in two flavours.

* Llama family (:func:`rms_norm`, :class:`RMSNorm`): ``x / sqrt(mean(x**2) + eps) * weight``;
* Qwen3.5 (:func:`zero_centered_rms_norm`, :class:`ZeroCenteredRMSNorm`):
  ``x / sqrt(mean(x**2) + eps) * (1 + weight)``, the weight stored zero-centred.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise ``x`` ([..., d], any float dtype) over its last dim and scale by
    ``weight`` (broadcastable to ``x``, e.g. ``[d]``, same dtype). Returns a new tensor of
    ``x``'s shape and dtype.

    Same arithmetic as Hugging Face ``LlamaRMSNorm``: the statistics in float32, the scale
    applied in ``x``'s dtype. (Written out rather than ``F.rms_norm``, which is up to 100x
    slower on CPU for many rows in torch 2.13.)
    """
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale ``weight`` of shape ``[dim]`` (uninitialised until loaded)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [..., dim] -> same shape and dtype."""
        return rms_norm(x, self.weight, self.eps)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim.

    Computed in float32 and cast back to ``x``'s dtype after the multiply (transformers
    ``Qwen3_5RMSNorm``: the weight is stored zero-centred; unlike Llama, the multiply
    happens before the cast). ``weight``: ``[d]``. Returns ``x``'s shape and dtype.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """:func:`zero_centered_rms_norm` with a ``weight`` ``[dim]`` (uninitialised until loaded)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)
