"""Sparse mixture-of-experts feed-forward of Qwen3.5 MoE (and the Qwen2/3-MoE family).

Rule (transformers 5.x ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``,
``Qwen3_5MoeSparseMoeBlock``), for each token ``x`` [hidden]:

* router: ``p = softmax(router_weight @ x)`` in float32 over ``num_experts``; the
  ``num_experts_per_tok`` largest ``p`` (``torch.topk`` order) pick the experts; when
  ``norm_topk_prob`` (the Qwen3.5 MoE rule, it has no switch) the picked ``p`` are divided by
  their sum; the weights are then cast to the activation dtype.
* routed experts: ``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))`` with per-expert SwiGLU of
  width ``moe_intermediate_size``.
* shared expert: ``sigmoid(shared_gate @ x) * SwiGLU_shared(x)`` of width
  ``shared_expert_intermediate_size``, added to the routed sum.

Two execution paths give the same result up to rounding: *grouped* (prefill; tokens sorted
by expert id, then one grouped matrix product per projection over all experts,
``torch._grouped_mm`` with device-tensor group offsets, where the device and dtype have it;
else one matmul pair per expert hit, which reads the counts on the host) and *gathered*
(decode, few tokens; the chosen experts' weights are gathered by device-tensor ids and
applied with batched matmuls: no host read, so it can be captured in a CUDA graph). The GPU
decode step replaces the gathered path by three fused Triton kernels
(:mod:`redlite.layers.triton_moe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redlite.layers.mlp import SwiGLU

__all__ = ["SparseMoE"]

#: At most this many tokens use the gathered path (decode); more use the grouped one.
GATHER_MAX_TOKENS = 4


class SparseMoE(nn.Module):
    """Router + routed SwiGLU experts + gated shared expert.

    Parameters (uninitialised until loaded), the experts stored as transformers keeps them:
    ``gates_weight`` [E + 1, hidden] (the router's rows, then the shared expert's gate row, so
    one matrix-vector product gives both; views ``router_weight`` and
    ``shared_gate_weight``); ``gate_up_weight`` [E, 2*inter, hidden] (each expert's gate
    rows first, then up rows); ``down_weight`` [E, hidden, inter]; ``shared`` a
    :class:`~redlite.layers.mlp.SwiGLU` of width ``shared_inter``. ``forward(x [T, hidden]) -> [T, hidden]`` in x's dtype.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int,
                 norm_topk_prob: bool = True, device=None, dtype=None, linear=None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k, self.inter = num_experts, top_k, inter
        self.norm_topk_prob = norm_topk_prob

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)

        self.gates_weight = param(num_experts + 1, hidden)
        self.gate_up_weight = param(num_experts, 2 * inter, hidden)
        self.down_weight = param(num_experts, hidden, inter)
        self.shared = SwiGLU(hidden, shared_inter, False, device, dtype, linear)

    @property
    def router_weight(self) -> torch.Tensor:
        """The router's rows of ``gates_weight``: [E, hidden]."""
        return self.gates_weight[: self.num_experts]

    @property
    def shared_gate_weight(self) -> torch.Tensor:
        """The shared expert's gate row of ``gates_weight``: [1, hidden]."""
        return self.gates_weight[self.num_experts:]

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint names relative to ``...mlp.`` -> parameter views, fused expert layout
        (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
        s = self.shared
        return {
            "gate.weight": self.router_weight,
            "experts.gate_up_proj": self.gate_up_weight,
            "experts.down_proj": self.down_weight,
            "shared_expert.gate_proj.weight": s.gate_up_weight[: s.inter],
            "shared_expert.up_proj.weight": s.gate_up_weight[s.inter:],
            "shared_expert.down_proj.weight": s.down_weight,
            "shared_expert_gate.weight": self.shared_gate_weight,
        }

    def hf_per_expert_targets(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Other layouts of the routed experts: name -> (the fused name it fills, the view of
        that fused parameter). The per-expert layout of published checkpoints
        (``experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I])
        and the stacked gate and up halves (``experts.gate_proj`` / ``experts.up_proj``
        [E, I, H], as GGUF files keep them)."""
        i = self.inter
        out: dict[str, tuple[str, torch.Tensor]] = {
            "experts.gate_proj": ("experts.gate_up_proj", self.gate_up_weight[:, :i]),
            "experts.up_proj": ("experts.gate_up_proj", self.gate_up_weight[:, i:]),
        }
        for e in range(self.num_experts):
            out[f"experts.{e}.gate_proj.weight"] = ("experts.gate_up_proj", self.gate_up_weight[e, :i])
            out[f"experts.{e}.up_proj.weight"] = ("experts.gate_up_proj", self.gate_up_weight[e, i:])
            out[f"experts.{e}.down_proj.weight"] = ("experts.down_proj", self.down_weight[e])
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of ``x`` [T, hidden]: (weights [T, k] in x's dtype, expert ids [T, k] int64)."""
        return self._route(F.linear(x, self.router_weight))

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gates_weight)  # router and shared gate in one product
        weights, ids = self._route(logits[:, : self.num_experts])
        routed = (self._gathered(x, weights, ids) if x.shape[0] <= GATHER_MAX_TOKENS
                  else self._grouped(x, weights, ids))
        shared = self.shared(x) * torch.sigmoid(logits[:, self.num_experts:])
        return routed + shared

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Only the chosen experts, by device-tensor ids: [T, k] experts via batched matmul."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)                       # [T*k, H, 1]
        gate, up = torch.bmm(self.gate_up_weight[flat], xs).squeeze(-1).split(self.inter, dim=-1)
        act = (F.silu(gate) * up).unsqueeze(-1)                                # [T*k, I, 1]
        out = torch.bmm(self.down_weight[flat], act).squeeze(-1)               # [T*k, H]
        return (out.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert id; grouped matmuls (see :func:`grouped_mm_supported`), else
        one gate/up and one down matmul per expert hit."""
        k = self.top_k
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        xs = x.index_select(0, order // k)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if grouped_mm_supported(x):
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            gate, up = torch._grouped_mm(xs, self.gate_up_weight.transpose(-2, -1), offs=offsets).split(
                self.inter, dim=-1)
            out = torch._grouped_mm(F.silu(gate) * up, self.down_weight.transpose(-2, -1), offs=offsets)
        else:
            out = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n == 0:
                    continue
                rows = slice(start, start + n)
                gate, up = F.linear(xs[rows], self.gate_up_weight[e]).split(self.inter, dim=-1)
                out[rows] = F.linear(F.silu(gate) * up, self.down_weight[e])
                start += n
        unsorted = torch.empty_like(out)
        unsorted[order] = out  # back to (token, k) order
        return (unsorted.view(*ids.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """True where ``torch._grouped_mm`` runs for ``x``: bfloat16 on a CUDA device of compute
    capability >= 8.0, or any float dtype on the CPU (torch >= 2.9 has a CPU kernel)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
