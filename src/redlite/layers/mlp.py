"""SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redlite.layers.linear import Linear


class SwiGLU(nn.Module):
    """Feed-forward of the Llama family.

    Layers (:class:`~redlite.layers.linear.Linear`, uninitialised until loaded): ``gate_up``
    [2*inter, hidden] (the gate rows first, then the up rows) and ``down`` [hidden, inter],
    with biases when ``bias``. ``gate_up_weight``, ``down_weight``, ``gate_up_bias`` and
    ``down_bias`` name their dense parameters (None for a quantized weight).
    """

    def __init__(self, hidden: int, inter: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.inter = inter
        self.gate_up = Linear(hidden, 2 * inter, bias, device, dtype)
        self.down = Linear(inter, hidden, bias, device, dtype)

    gate_up_weight = property(lambda self: self.gate_up.weight)
    gate_up_bias = property(lambda self: self.gate_up.bias)
    down_weight = property(lambda self: self.down.weight)
    down_bias = property(lambda self: self.down.bias)

    def load(self, gate, up, down, gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
             down_bias: torch.Tensor | None = None) -> None:
        """Load Hugging Face ``gate_proj``/``up_proj`` ([inter, hidden]) and ``down_proj``
        ([hidden, inter]) weights, tensors or quantized tensors (see
        :meth:`~redlite.layers.linear.Linear.load`), and biases when the block has them."""
        self.gate_up.load([gate, up], [gate_bias, up_bias])
        self.down.load([down], [down_bias])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [T, hidden] -> [T, hidden], same dtype."""
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate).mul_(up))
