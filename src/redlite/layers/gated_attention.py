"""Qwen3.5 gated full attention (:class:`GatedAttention`).

``q_proj`` yields, per head, ``[query (D) | gate (D)]``; q and k get the zero-centred
RMSNorm (:func:`redlite.layers.norm.zero_centered_rms_norm`) over the head dim, then rotary
embedding on the first ``int(D * partial_rotary_factor)`` dims (rotate-half form, tables from
:class:`~redlite.layers.rotary.RotaryTable`); GQA attention with scale ``D ** -0.5``; the
output is multiplied by ``sigmoid(gate)`` before ``o_proj``. As transformers 5.x
``Qwen3_5Attention``; used by the full-attention layers of
:class:`redlite.models.qwen3_5.Qwen3_5Model`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redlite.layers.attention import sdpa_backends
from redlite.layers.linear import linear_kernel
from redlite.layers.norm import zero_centered_rms_norm
from redlite.layers.rotary import apply_rotary

__all__ = ["GatedAttention"]


def _param(*shape, device=None, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class GatedAttention(nn.Module):
    """Qwen3.5 full attention: q/k zero-centred RMSNorm, partial rotary, GQA, sigmoid gate.

    Parameters (uninitialised until loaded; :meth:`hf_targets` maps checkpoint names):
    ``qkv_weight`` ``[(2*H + 2*Hkv) * D, hidden]`` (rows: ``q_proj`` — per head ``D`` query
    rows then ``D`` gate rows — then ``k_proj``, ``v_proj``), optional ``qkv_bias``;
    ``o_weight`` ``[hidden, H*D]``, optional ``o_bias``; ``q_norm_weight`` /
    ``k_norm_weight`` ``[D]``.
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 bias: bool = False, eps: float = 1e-6, device=None, dtype=None,
                 linear=None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.eps = float(eps)
        self.linear = linear or linear_kernel(device, dtype)
        self.q_rows = 2 * n_heads * head_dim
        self.kv_rows = n_kv_heads * head_dim
        rows = self.q_rows + 2 * self.kv_rows
        self.qkv_weight = _param(rows, hidden, device=device, dtype=dtype)
        self.qkv_bias = _param(rows, device=device, dtype=dtype) if bias else None
        self.o_weight = _param(hidden, n_heads * head_dim, device=device, dtype=dtype)
        self.o_bias = _param(hidden, device=device, dtype=dtype) if bias else None
        self.q_norm_weight = _param(head_dim, device=device, dtype=dtype)
        self.k_norm_weight = _param(head_dim, device=device, dtype=dtype)

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint names (relative to ``...self_attn.``) -> parameter views."""
        q, kv = self.q_rows, self.kv_rows
        targets = {
            "q_proj.weight": self.qkv_weight[:q],
            "k_proj.weight": self.qkv_weight[q:q + kv],
            "v_proj.weight": self.qkv_weight[q + kv:],
            "o_proj.weight": self.o_weight,
            "q_norm.weight": self.q_norm_weight,
            "k_norm.weight": self.k_norm_weight,
        }
        if self.qkv_bias is not None:
            targets.update({"q_proj.bias": self.qkv_bias[:q], "k_proj.bias": self.qkv_bias[q:q + kv],
                            "v_proj.bias": self.qkv_bias[q + kv:], "o_proj.bias": self.o_bias})
        return targets

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attend ``x`` (``[T, hidden]``) at positions ``start .. start + T - 1``.

        ``cos``/``sin``: rotary tables ``[T, 1, rotary_dim]`` from
        :class:`~redlite.layers.rotary.RotaryTable`. ``keys``/``values``: this layer's cache
        ``[Hkv, max_tokens, D]``; rows ``< start`` are read, the T new ones written.
        ``mask``: as :func:`redlite.layers.attention.prefill_mask` gives it (the rule the
        Llama attention uses: None for causal from 0 or a single token, a lower-right causal
        bias on CUDA, which keeps chunked prefill on the flash kernel, else a bool
        ``[T, start + T]``).
        Returns ``[T, hidden]``.
        """
        n_new = x.shape[0]
        end = start + n_new
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.linear(x, self.qkv_weight, self.qkv_bias)
        q, gate = qkv[:, :self.q_rows].view(n_new, h, 2 * d).split(d, dim=-1)
        k = qkv[:, self.q_rows:self.q_rows + self.kv_rows].view(n_new, hkv, d)
        v = qkv[:, self.q_rows + self.kv_rows:].view(n_new, hkv, d)
        q = apply_rotary(zero_centered_rms_norm(q, self.q_norm_weight, self.eps), cos, sin)
        k = apply_rotary(zero_centered_rms_norm(k, self.k_norm_weight, self.eps), cos, sin)
        keys.narrow(1, start, n_new).copy_(k.transpose(0, 1))
        values.narrow(1, start, n_new).copy_(v.transpose(0, 1))
        with sdpa_backends(x.device):
            if n_new == 1 and mask is None:
                # one query sees every held key: the query heads of each kv head become the
                # "positions" of one attention per kv head (no mask, no repeat of K/V)
                out = F.scaled_dot_product_attention(
                    q.reshape(1, hkv, h // hkv, d), keys[None, :, :end], values[None, :, :end])
            else:
                # 4-D inputs: the CPU flash kernel rejects 3-D ones
                out = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                    is_causal=mask is None, enable_gqa=h != hkv)[0].transpose(0, 1)
        out = out.reshape(n_new, h * d) * torch.sigmoid(gate.reshape(n_new, h * d))
        return self.linear(out, self.o_weight, self.o_bias)
