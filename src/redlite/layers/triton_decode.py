"""Triton kernels of the one-token decode step (CUDA; importable only where Triton is).

Each kernel replaces a chain of small torch ops, so a CUDA-graph replay of the decode step
launches about ten kernels per layer (four of them matrix-vector products) and every kernel
reads the position from a device tensor (no host value baked in but the shapes):

* ``add_rms_norm``: ``x += delta`` (rounded to x's dtype), then RMSNorm of x.
* ``qk_rope_store``: per head of the fused qkv row: q/k RMSNorm (Qwen3), rotary embedding at
  ``pos``, q to an output buffer, k and v written into the KV cache at ``pos``.
* ``decode_attention``: split-KV ("flash decoding") attention of one query over keys
  ``0..pos`` (or the last ``window``), each program one KV head (its query heads as the rows
  of a small matrix product) and one slice of the keys, then a combine kernel. The number of
  keys comes from ``pos`` on the device, so one captured graph serves every context length.
* ``silu_mul``: ``silu(gate) * up`` of the fused gate/up row.

The rounding follows the torch reference ops in :mod:`redlite.layers.decode_ops` (the eager
model) step by step: statistics in float32, results rounded to the model dtype where torch
rounds them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 40  # the window of full attention (keeps the kernel free of branches)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        xr = (x + d).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n_cols + cols, xr, mask=mask)
        x = xr.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, nw_ptr, q_ptr, k_ptr, v_ptr,
                          stride_cos, stride_kh, stride_kt, stride_vh, stride_vt, eps,
                          H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                          HAS_NORM: tl.constexpr):
    head = tl.program_id(0)
    pos = tl.load(pos_ptr)
    d = tl.arange(0, D)
    dt = q_ptr.dtype.element_ty
    if head < H + KV:
        base = qkv_ptr + head * D
        rot = d < R
        swap = tl.where(d < R // 2, d + R // 2, d - R // 2)
        x = tl.load(base + d).to(tl.float32)
        xs = tl.load(base + swap, mask=rot, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(nw_ptr + head * D + d).to(tl.float32)
            ws = tl.load(nw_ptr + head * D + swap, mask=rot, other=0.0).to(tl.float32)
            x = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xs = (ws * (xs * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c = tl.load(cos_ptr + pos * stride_cos + d, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + d, mask=rot, other=0.0).to(tl.float32)
        a = (x * c).to(dt).to(tl.float32)
        y = tl.where(rot, a + xs * s, x).to(dt)
        if head < H:
            tl.store(q_ptr + head * D + d, y)
        else:
            tl.store(k_ptr + (head - H) * stride_kh + pos * stride_kt + d, y)
    else:
        vh = head - H - KV
        v = tl.load(qkv_ptr + (H + KV) * D + vh * D + d)
        tl.store(v_ptr + vh * stride_vh + pos * stride_vt + d, v)


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, lse_ptr,
                       stride_kh, stride_kt, stride_vh, stride_vt, window, qk_scale, n_splits,
                       H: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(pos_ptr) + 1  # keys 0 .. pos are valid
    first = tl.maximum(n - window, 0)  # window: 2**40 for full attention
    per = tl.cdiv(tl.cdiv(n - first, n_splits), BLOCK_N) * BLOCK_N
    lo = first + split * per
    hi = tl.minimum(lo + per, n)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cmask = cols < hi
        # keys loaded as [D, BLOCK_N] (transposed by the addressing) so the loads go through
        # shared memory and the loop is software-pipelined; values issued at the same time
        kt = tl.load(k_base + d[:, None] + cols[None, :] * stride_kt, mask=cmask[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + d[None, :], mask=cmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(cmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    full = l_i > 0
    out = acc / tl.where(full, l_i, 1.0)[:, None]
    lse = tl.where(full, m_i + tl.log2(tl.where(full, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + (split * H + heads)[:, None] * D + d[None, :], out, mask=gmask[:, None])
    tl.store(lse_ptr + split * H + heads, lse, mask=gmask)


@triton.jit
def _attn_combine_kernel(o_ptr, lse_ptr, out_ptr, n_splits,
                         H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    head = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    smask = s < n_splits
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + s * H + head, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - m)
    o = tl.load(o_ptr + (s[:, None] * H + head) * D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(dt), mask=mask)


# --- launchers -------------------------------------------------------------------------------

def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ([T, n] contiguous) ``+= delta`` in place (when given), then return
    ``rms_norm(x, weight, eps)`` as a new [T, n] tensor of x's dtype."""
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    _add_rms_norm_kernel[(rows,)](x, x if delta is None else delta, weight, out, n_cols, eps,
                                  HAS_DELTA=delta is not None, BLOCK=block,
                                  num_warps=8 if block >= 4096 else 4)
    return out


def qk_rope_store(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  norm_weight: torch.Tensor | None, eps: float, keys: torch.Tensor, values: torch.Tensor,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """See :func:`redlite.layers.decode_ops.TorchDecodeOps.qk_rope_store`; ``head_dim`` must be
    a power of two and ``cos``/``sin`` ``[positions, 1, rotary_dim]`` with unit last stride."""
    q = torch.empty(n_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    _qk_rope_store_kernel[(n_heads + 2 * n_kv_heads,)](
        qkv, pos, cos, sin, qkv if norm_weight is None else norm_weight, q, keys, values,
        cos.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), eps,
        H=n_heads, KV=n_kv_heads, D=head_dim, R=cos.shape[-1], HAS_NORM=norm_weight is not None,
        num_warps=1)
    return q


# H200, Qwen3-8B shape, 32k keys, one layer (bench/gpu_tune.py --quick, two machines,
# 2026-11-29): stages 2 / 33 splits 47.1 and 44.0 us, stages 3 / 33 splits 39.9 and 41.3 us
# (2.9-3.4 TB/s); 66 splits, block_n 128 or 8 warps were no better on the second machine.
ATTN_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 3, "splits_per_sm": 2}


def default_splits(device: torch.device, n_kv_heads: int) -> int:
    """Key slices per KV head: ``ATTN_CONFIG["splits_per_sm"]`` programs per multiprocessor
    over all KV heads (at least 1, at most 128)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(128, math.ceil(ATTN_CONFIG["splits_per_sm"] * sms / n_kv_heads)))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                     window: int | None, n_splits: int, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Attention of one token: ``q`` [H, D] over ``keys``/``values`` [KV, max_tokens, D] rows
    ``0..pos`` (``pos``: LongTensor [1] on the device), or the last ``window`` of them.
    Returns [H, D] in q's dtype. Scale ``1/sqrt(D)``. ``block_n`` (keys per step),
    ``num_warps``, ``num_stages``: launch settings, default ``ATTN_CONFIG``."""
    block_n = block_n or ATTN_CONFIG["block_n"]
    num_warps = num_warps or ATTN_CONFIG["num_warps"]
    num_stages = num_stages or ATTN_CONFIG["num_stages"]
    n_heads, head_dim = q.shape
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    o_part = torch.empty(n_splits, n_heads, head_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(n_splits, n_heads, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    _attn_split_kernel[(n_kv, n_splits)](
        q, keys, values, pos, o_part, lse, keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), int(window or NO_WINDOW), LOG2E / math.sqrt(head_dim), n_splits,
        H=n_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        D=head_dim, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    _attn_combine_kernel[(n_heads,)](o_part, lse, out, n_splits, H=n_heads, D=head_dim,
                                     BLOCK_S=triton.next_power_of_2(n_splits), num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` ([T, 2*inter] contiguous) -> [T, inter]."""
    rows = gate_up.shape[0]
    out = torch.empty(rows, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
