"""SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redlite.layers.linear import assign_weight, linear_kernel


class SwiGLU(nn.Module):
    """Feed-forward of the Llama family.

    Parameters (uninitialised until loaded): ``gate_up_weight`` [2*inter, hidden] (the gate
    rows first, then the up rows), ``down_weight`` [hidden, inter], optional biases
    ``gate_up_bias`` [2*inter] and ``down_bias`` [hidden] when ``bias``.
    """

    def __init__(self, hidden: int, inter: int, bias: bool = False, device=None, dtype=None,
                 linear=None):
        super().__init__()
        self.inter = inter
        self.linear = linear or linear_kernel(device, dtype)

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)

        self.gate_up_weight = param(2 * inter, hidden)
        self.down_weight = param(hidden, inter)
        self.gate_up_bias = param(2 * inter) if bias else None
        self.down_bias = param(hidden) if bias else None

    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
             down_bias: torch.Tensor | None = None) -> None:
        """Load Hugging Face ``gate_proj``/``up_proj`` ([inter, hidden]) and ``down_proj``
        ([hidden, inter]) weights (tensors, or GGUF blocks: see
        :func:`~redlite.layers.linear.assign_weight`), and biases when the block has them."""
        assign_weight(self, "gate_up_weight", [gate, up])
        assign_weight(self, "down_weight", [down])
        if self.gate_up_bias is not None:
            self.gate_up_bias[: self.inter].copy_(gate_bias)
            self.gate_up_bias[self.inter:].copy_(up_bias)
            self.down_bias.copy_(down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [T, hidden] -> [T, hidden], same dtype."""
        gate_up = self.linear(x, self.gate_up_weight, self.gate_up_bias)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.linear(F.silu(gate).mul_(up), self.down_weight, self.down_bias)
