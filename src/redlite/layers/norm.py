"""RMSNorm (Llama family): ``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise ``x`` ([..., d], any float dtype) over its last dim and scale by
    ``weight`` ([d], same dtype). Returns a new tensor of ``x``'s shape and dtype.

    The mean of squares is accumulated in float32 for bfloat16/float16 inputs (as in
    Hugging Face ``LlamaRMSNorm``).
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    y = F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    return y * weight


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale ``weight`` of shape ``[dim]`` (uninitialised until loaded)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [..., dim] -> same shape and dtype."""
        return rms_norm(x, self.weight, self.eps)
