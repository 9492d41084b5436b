"""The operations of the graph-capturable one-token decode step, in two implementations.

The decode step (:meth:`redlite.models.llama.LlamaModel.decode_step`) takes the token and
its position as device tensors, so it can be captured once in a CUDA graph and replayed at
any position. Its non-matmul work goes through a :class:`DecodeOps`:

* :class:`TorchDecodeOps`: plain torch ops, on any device; the same arithmetic as the
  eager forward pass (it is the reference). Its attention reads ``span`` cache slots and
  masks those past ``pos``, so a graph captured with it serves positions ``< span`` (the
  graph runner keeps one graph per span "bucket"). The unused cache slots must hold finite
  values (the runner zeroes them once).
* :class:`TritonDecodeOps` (CUDA with Triton): fused kernels from
  :mod:`redlite.layers.triton_decode`; attention reads only the keys up to ``pos``, so
  ``span`` is ignored and one graph serves every position (``length_from_pos`` True).

:func:`decode_ops` picks one for a device, dtype and head size.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from redlite.layers.norm import rms_norm
from redlite.layers.rotary import apply_rotary

log = logging.getLogger("redlite.decode_ops")


class TorchDecodeOps:
    """Reference implementation (any device). ``length_from_pos``: False (attention reads
    ``span`` slots)."""

    name = "torch"
    length_from_pos = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x`` [T, n] -> new [T, n] (see :func:`redlite.layers.norm.rms_norm`)."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += delta`` in place ([T, n], rounded to x's dtype), then RMSNorm of x (new tensor)."""
        x.add_(delta)
        return rms_norm(x, weight, eps)

    def qk_rope_store(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      norm_weight: torch.Tensor | None, eps: float, keys: torch.Tensor,
                      values: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Split the fused projection ``qkv`` [1, (H + 2 KV) * D] into heads, RMSNorm q and k
        per head when ``norm_weight`` ([H + KV, D]) is given, rotate them to position ``pos``
        (LongTensor [1]; ``cos``/``sin`` the whole tables ``[positions, 1, rotary_dim]`` from
        :meth:`RotaryTable.get`), write k and v into ``keys``/``values`` [KV, max_tokens, D]
        at ``pos``; return q [H, D] (new tensor, qkv's dtype)."""
        qk_dim = (n_heads + n_kv_heads) * head_dim
        qk = qkv[:, :qk_dim].unflatten(-1, (n_heads + n_kv_heads, head_dim))
        if norm_weight is not None:
            qk = rms_norm(qk, norm_weight, eps)
        qk = apply_rotary(qk, cos.index_select(0, pos), sin.index_select(0, pos))
        v = qkv[:, qk_dim:].unflatten(-1, (n_kv_heads, head_dim))
        keys.index_copy_(1, pos, qk[:, n_heads:].transpose(0, 1))
        values.index_copy_(1, pos, v.transpose(0, 1))
        return qk[0, :n_heads]

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                  span: int, window: int | None) -> torch.Tensor:
        """Attention of ``q`` [H, D] over cache rows ``0..pos`` (the last ``window`` with a
        sliding window) of ``keys``/``values`` [KV, max_tokens, D]; reads rows ``< span``
        (``span > pos``). Returns [H, D]."""
        n_heads, head_dim = q.shape
        n_kv = keys.shape[0]
        slots = torch.arange(span, device=q.device)
        valid = slots <= pos
        if window is not None:
            valid &= slots > pos - window
        qg = q.view(1, n_kv, n_heads // n_kv, head_dim)
        out = F.scaled_dot_product_attention(qg, keys[None, :, :span], values[None, :, :span],
                                             attn_mask=valid.view(1, 1, 1, span))
        return out.reshape(n_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` [T, 2 * inter] (gate first) -> new [T, inter]."""
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate).mul_(up)


class TritonDecodeOps(TorchDecodeOps):
    """Fused Triton kernels (CUDA). ``length_from_pos``: True (attention reads keys up to
    ``pos`` only; ``span`` is ignored). ``n_splits``: key slices per KV head in attention."""

    name = "triton"
    length_from_pos = True

    def __init__(self, device: torch.device, n_kv_heads: int):
        from redlite.layers import triton_decode

        self.kernels = triton_decode
        self.n_splits = triton_decode.default_splits(torch.device(device), n_kv_heads)

    def rms_norm(self, x, weight, eps):
        return self.kernels.add_rms_norm(x, None, weight, eps)

    def add_rms_norm(self, x, delta, weight, eps):
        return self.kernels.add_rms_norm(x, delta, weight, eps)

    def qk_rope_store(self, qkv, pos, cos, sin, norm_weight, eps, keys, values, n_heads, n_kv_heads, head_dim):
        return self.kernels.qk_rope_store(qkv, pos, cos, sin, norm_weight, eps, keys, values,
                                          n_heads, n_kv_heads, head_dim)

    def attention(self, q, keys, values, pos, span, window):
        return self.kernels.decode_attention(q, keys, values, pos, window, self.n_splits)

    def silu_mul(self, gate_up, inter):
        return self.kernels.silu_mul(gate_up, inter)


def triton_available() -> bool:
    """True when Triton imports (and ``REDLITE_TRITON`` is not ``0``)."""
    if os.environ.get("REDLITE_TRITON", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken install: use torch ops
        return False
    return True


def decode_ops(device: torch.device | str, dtype: torch.dtype, head_dim: int, n_kv_heads: int) -> TorchDecodeOps:
    """The ops for a decode step on ``device`` in ``dtype``: Triton kernels on CUDA for
    float32/bfloat16/float16 and a power-of-two ``head_dim`` >= 16 when Triton imports,
    else the torch reference."""
    device = torch.device(device)
    pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if (device.type == "cuda" and pow2 and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and triton_available()):
        return TritonDecodeOps(device, n_kv_heads)
    if device.type == "cuda":
        log.warning("decode step uses torch ops (Triton missing or head_dim %d unsupported)", head_dim)
    return TorchDecodeOps()
