"""Grouped-query self-attention of the Llama family, writing into a preallocated KV cache.

Covers Llama/Mistral (no bias, or ``attention_bias`` on all four projections), Qwen2
(bias on q/k/v only) and Qwen3 (RMSNorm over each q and k head before RoPE).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from redlite.layers.linear import assign_weight, linear_kernel
from redlite.layers.norm import rms_norm
from redlite.layers.rotary import apply_rotary


_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device):
    """Context for SDPA calls on ``device``: on CUDA, flash / memory-efficient / math only.
    (A quick H200 run showed a per-new-shape cost of tens of ms in the default dispatch, on
    eager decode and on prefills of new lengths, which plan-building backends would explain;
    these three have none.) Elsewhere a no-op."""
    return sdpa_kernel(_CUDA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def prefill_mask(start: int, n_new: int, window: int | None, device):
    """The ``mask`` argument of :meth:`Attention.forward` for ``n_new`` tokens after
    ``start``: None for plain causal attention from position 0 (or a single token); on CUDA
    without a window, a lower-right causal bias (``torch.nn.attention.bias``), which keeps
    chunked prefill on the flash kernel; else a boolean :func:`causal_mask`."""
    if n_new == 1 or (start == 0 and (window is None or n_new <= window)):
        return None
    if window is None and torch.device(device).type == "cuda":
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: seconds

        return causal_lower_right(n_new, start + n_new)
    return causal_mask(start, n_new, window, device)


def causal_mask(start: int, n_new: int, window: int | None, device) -> torch.Tensor:
    """Boolean mask ``[n_new, start + n_new]``: query ``i`` (position ``start + i``) may see
    key ``j`` iff ``j <= start + i`` and, with a sliding ``window``, ``start + i - j < window``."""
    q_pos = torch.arange(start, start + n_new, device=device)[:, None]
    k_pos = torch.arange(start + n_new, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def cache_rows(keys: torch.Tensor, values: torch.Tensor, first: int, end: int, dtype: torch.dtype):
    """Rows ``first .. end - 1`` of a layer's cache (``[n_kv_heads, max_tokens, head_dim]``) as
    ``[1, n_kv_heads, end - first, head_dim]`` keys and values in ``dtype``: views when the
    cache holds ``dtype``, else widened copies (a float16 cache under float32 queries; the
    values read are the rounded ones every path reads)."""
    k, v = keys[None, :, first:end], values[None, :, first:end]
    if k.dtype != dtype:
        k, v = k.to(dtype), v.to(dtype)
    return k, v


class Attention(nn.Module):
    """Self-attention with ``n_heads`` query heads sharing ``n_kv_heads`` key/value heads.

    Parameters (uninitialised until :meth:`load`): ``qkv_weight``
    [(n_heads + 2 * n_kv_heads) * head_dim, hidden] (q rows, then k, then v), optional
    ``qkv_bias``; ``o_weight`` [hidden, n_heads * head_dim], optional ``o_bias``; with
    ``qk_norm``, ``qk_norm_weight`` [n_heads + n_kv_heads, head_dim] (the q-norm weight
    repeated per q head, then the k-norm weight per k head).
    ``window``: sliding-window size in tokens (None: full attention).
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = 1e-6, window: int | None = None, device=None, dtype=None,
                 linear=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.qk_dim = (n_heads + n_kv_heads) * head_dim
        self.norm_eps = float(norm_eps)
        self.window = window
        self.linear = linear or linear_kernel(device, dtype)

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)

        self.qkv_weight = param((n_heads + 2 * n_kv_heads) * head_dim, hidden)
        self.qkv_bias = param((n_heads + 2 * n_kv_heads) * head_dim) if qkv_bias else None
        self.o_weight = param(hidden, n_heads * head_dim)
        self.o_bias = param(hidden) if o_bias else None
        self.qk_norm_weight = param(n_heads + n_kv_heads, head_dim) if qk_norm else None

    def load(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             biases: tuple | None = None, q_norm: torch.Tensor | None = None,
             k_norm: torch.Tensor | None = None) -> None:
        """Load Hugging Face ``q_proj``/``k_proj``/``v_proj``/``o_proj`` weights (tensors, or
        GGUF blocks: see :func:`~redlite.layers.linear.assign_weight`); ``biases`` is
        ``(q, k, v, o)`` with None where absent; ``q_norm``/``k_norm`` are ``[head_dim]``."""
        assign_weight(self, "qkv_weight", [q, k, v])
        assign_weight(self, "o_weight", [o])
        if self.qkv_bias is not None:
            self.qkv_bias.copy_(torch.cat([b.reshape(-1) for b in biases[:3]]))
        if self.o_bias is not None:
            self.o_bias.copy_(biases[3])
        if self.qk_norm_weight is not None:
            self.qk_norm_weight[: self.n_heads].copy_(q_norm)
            self.qk_norm_weight[self.n_heads:].copy_(k_norm)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attend ``x`` ([T, hidden]) at positions ``start .. start + T - 1``.

        ``cos``/``sin``: rotary tables ``[T, 1, rotary_dim]``. ``keys``/``values``: this
        layer's cache ``[n_kv_heads, max_tokens, head_dim]``; positions ``< start`` are read,
        the T new ones written. ``mask``: bool ``[T, start + T]`` (see :func:`causal_mask`),
        a lower-right causal bias, or None for plain causal attention from position 0 or
        for a single token (see :func:`prefill_mask`).
        Returns ``[T, hidden]``.
        """
        n_new = x.shape[0]
        end = start + n_new
        heads, kv_heads, head_dim = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.linear(x, self.qkv_weight, self.qkv_bias)
        qk = qkv[:, : self.qk_dim].unflatten(-1, (heads + kv_heads, head_dim))
        if self.qk_norm_weight is not None:
            qk = rms_norm(qk, self.qk_norm_weight, self.norm_eps)
        qk = apply_rotary(qk, cos, sin)
        v = qkv[:, self.qk_dim:].unflatten(-1, (kv_heads, head_dim))
        keys.narrow(1, start, n_new).copy_(qk[:, heads:].transpose(0, 1))
        values.narrow(1, start, n_new).copy_(v.transpose(0, 1))
        if n_new == 1 and mask is None:
            # One query sees every held key: group the query heads of each key/value head as
            # "positions" of one attention per kv head (no mask, no repeat of K/V).
            first = 0 if self.window is None else max(0, end - self.window)
            q = qk[0, :heads].view(1, kv_heads, heads // kv_heads, head_dim)
            k, v = cache_rows(keys, values, first, end, q.dtype)
            with sdpa_backends(x.device):
                out = F.scaled_dot_product_attention(q, k, v)
            return self.linear(out.reshape(1, heads * head_dim), self.o_weight, self.o_bias)
        # 4-D inputs: the CPU flash kernel rejects 3-D ones (and the math fallback is slow).
        q = qk[None, :, :heads].transpose(1, 2)
        k, v = cache_rows(keys, values, 0, end, q.dtype)
        with sdpa_backends(x.device):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask,
                is_causal=mask is None, enable_gqa=heads != kv_heads)
        return self.linear(out[0].transpose(0, 1).reshape(n_new, -1), self.o_weight, self.o_bias)

    def decode_attend(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, span: int, ops) -> torch.Tensor:
        """Attend one token from its fused projection ``qkv`` ([1, (H + 2 KV) * D], before
        q/k norm and rotary) at the position held in ``pos`` (LongTensor [1] on the device)
        without reading it on the host (CUDA-graph capturable). The output projection is left
        to the caller (so it can be fused with the residual add).

        ``cos``/``sin``: whole rotary tables ``[positions, 1, rotary_dim]``. ``keys``/
        ``values``: this layer's cache; row ``pos`` is written, rows ``< pos`` read. ``span``:
        cache rows the torch ops may read (``> pos``). ``ops``: a
        :class:`~redlite.layers.decode_ops.TorchDecodeOps`. Returns [1, H * D].
        """
        out = ops.rope_attend(qkv, pos, cos, sin, self.qk_norm_weight, self.norm_eps, keys, values,
                              self.n_heads, self.n_kv_heads, self.head_dim, span, self.window)
        return out.reshape(1, -1)
