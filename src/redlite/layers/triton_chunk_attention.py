"""Attention of a short chunk of T new tokens of one sequence over its KV cache, with the
chunk's first position a device tensor (CUDA; importable only where Triton is).

The chunk counterpart of :func:`redlite.layers.triton_decode.decode_attention`, for the
captured short prefill (:mod:`redlite.models.chunk_step`): no host read, no shape that
depends on the position, so one CUDA graph per chunk length serves every position. Three
launches:

* :func:`_chunk_qkv_kernel` (one program per token): q/k RMSNorm per head (when given),
  rotary at position ``pos + t``, q into a [T, H, D] buffer, k and v into the cache at
  ``pos + t``. All rows are written before any is read, so token t sees tokens ``< t`` of
  its own chunk.
* :func:`_chunk_attention_kernel` (row blocks x KV heads x key slices): the rows of a
  program are (token, query head of this KV head) pairs; each row sees keys ``0 .. pos + t``
  (the last ``window`` of them with a sliding window). Partial outputs and log-sum-exps per
  slice ("flash decoding" with several queries).
* :func:`_chunk_combine_kernel` (one program per token and query head): the slices weighted
  by their log-sum-exps.

Rounding of q/k/v follows :func:`redlite.layers.triton_decode._norm_rope` (as the torch
reference, :meth:`redlite.layers.decode_ops.TorchDecodeOps.chunk_rope_attend`, rounds).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from redlite.layers import triton_decode as td

#: query rows (token, head pairs) per attention program, keys per step, warps
CHUNK_CONFIG = {"block_r": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}


@triton.jit
def _chunk_qkv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, nw_ptr, q_ptr, k_ptr, v_ptr, row_stride, stride_cos,
                      stride_kh, stride_kt, stride_vh, stride_vt, eps, H: tl.constexpr, KV: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                      HAS_NORM: tl.constexpr):
    t = tl.program_id(0)
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr) + t
    d = tl.arange(0, D)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < R, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=d < R, other=0.0).to(tl.float32)
    base = qkv_ptr + t * row_stride
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < H
    q = td._norm_rope(base, hs, hmask, D, nw_ptr, hs, c, s, eps, D, R, HAS_NORM, False, dt)
    tl.store(q_ptr + (t * H + hs)[:, None] * D + d[None, :], q, mask=hmask[:, None])
    ks = tl.arange(0, BLOCK_KV)
    kmask = ks < KV
    k = td._norm_rope(base + H * D, ks, kmask, D, nw_ptr, H + ks, c, s, eps, D, R, HAS_NORM, False, dt)
    tl.store(k_ptr + ks[:, None] * stride_kh + pos * stride_kt + d[None, :], k, mask=kmask[:, None])
    v = tl.load(base + (H + KV) * D + ks[:, None] * D + d[None, :], mask=kmask[:, None], other=0.0)
    tl.store(v_ptr + ks[:, None] * stride_vh + pos * stride_vt + d[None, :], v, mask=kmask[:, None])


@triton.jit
def _chunk_attention_kernel(q_ptr, pos_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T, n_splits, window, qk_scale,
                            stride_kh, stride_kt, stride_vh, stride_vt, H: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    # row blocks are the fastest grid axis: the programs reading one key slice run together
    # and share its reads through L2
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = r // GROUP
    head = kvh * GROUP + r % GROUP
    rmask = t < T
    pos = tl.load(pos_ptr)
    last = pos + t  # each row's own position: it sees keys 0 .. last
    end = pos + T
    first = tl.maximum(pos + 1 - window, 0)  # window: 2**40 for full attention
    per = tl.cdiv(tl.cdiv(end - first, n_splits), BLOCK_N) * BLOCK_N
    lo = first + split * per
    hi = tl.minimum(lo + per, end)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (t * H + head)[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cmask = cols < hi
        kt = tl.load(k_base + d[:, None] + cols[None, :] * stride_kt, mask=cmask[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + d[None, :], mask=cmask[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, kt, input_precision="ieee")
        else:
            sc = tl.dot(q, kt)
        seen = cmask[None, :] & (cols[None, :] <= last[:, None]) & (cols[None, :] > last[:, None] - window)
        sc = tl.where(seen, sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key seen yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    full = l_i > 0
    out = acc / tl.where(full, l_i, 1.0)[:, None]
    lse = tl.where(full, m_i + tl.log2(tl.where(full, l_i, 1.0)), float("-inf"))
    row = (split * T + t) * H + head
    tl.store(o_ptr + row[:, None] * D + d[None, :], out, mask=rmask[:, None])
    tl.store(lse_ptr + row, lse, mask=rmask)


@triton.jit
def _chunk_combine_kernel(o_ptr, lse_ptr, out_ptr, n_splits, TH, D: tl.constexpr, BLOCK_S: tl.constexpr,
                          DC: tl.constexpr):
    th = tl.program_id(0)  # token * H + head
    dc = tl.program_id(1) * DC + tl.arange(0, DC)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < n_splits
    part_lse = tl.load(lse_ptr + sp * TH + th, mask=smask, other=float("-inf"))
    w = tl.exp2(part_lse - tl.max(part_lse, axis=0))  # every row sees its own key: max is finite
    part = tl.load(o_ptr + (sp * TH + th)[:, None] * D + dc[None, :], mask=smask[:, None], other=0.0)
    res = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + th * D + dc, res.to(out_ptr.dtype.element_ty))


def chunk_splits(device: torch.device, n_kv_heads: int, head_dim: int | None = None) -> int:
    """Key slices per KV head: those of the one-token kernel
    (:func:`~redlite.layers.triton_decode.default_splits`)."""
    return td.default_splits(device, n_kv_heads, head_dim)


def chunk_attention(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    norm_weight: torch.Tensor | None, eps: float, keys: torch.Tensor, values: torch.Tensor,
                    n_heads: int, n_kv_heads: int, head_dim: int, window: int | None,
                    n_splits: int, config: dict | None = None) -> torch.Tensor:
    """Attention of T consecutive tokens of one sequence from their fused projections ``qkv``
    [T, (H + 2 KV) * D] (contiguous rows), token t at position ``pos + t`` (``pos``:
    LongTensor [1] on the device; ``pos + T <= max_tokens``, unchecked). q/k RMSNorm with
    ``norm_weight`` [H + KV, D] when given, rotary from the tables ``cos``/``sin``
    [positions, 1, rotary_dim]; k and v written into ``keys``/``values`` [KV, max_tokens, D]
    at ``pos .. pos + T - 1``. Token t attends to rows ``0 .. pos + t`` (the last ``window``
    with a sliding window); scale ``1/sqrt(D)``. Returns [T, H * D] in qkv's dtype.
    ``n_splits``: key slices per KV head; ``config``: overrides of ``CHUNK_CONFIG``."""
    cfg = {**CHUNK_CONFIG, **(config or {})}
    n_tokens = qkv.shape[0]
    group = n_heads // n_kv_heads
    dev, dtype = qkv.device, qkv.dtype
    q = torch.empty(n_tokens, n_heads, head_dim, device=dev, dtype=dtype)
    _chunk_qkv_kernel[(n_tokens,)](
        qkv, pos, cos, sin, qkv if norm_weight is None else norm_weight, q, keys, values, qkv.stride(0),
        cos.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), float(eps), H=n_heads,
        KV=n_kv_heads, BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_KV=triton.next_power_of_2(n_kv_heads),
        D=head_dim, R=cos.shape[-1], HAS_NORM=norm_weight is not None, num_warps=4)
    o_part = torch.empty(n_splits, n_tokens, n_heads, head_dim, device=dev, dtype=torch.float32)
    lse = torch.empty(n_splits, n_tokens, n_heads, device=dev, dtype=torch.float32)
    rows = n_tokens * group
    block_r = max(16, min(cfg["block_r"], triton.next_power_of_2(rows)))
    _chunk_attention_kernel[(triton.cdiv(rows, block_r), n_kv_heads, n_splits)](
        q, pos, keys, values, o_part, lse, n_tokens, n_splits, int(window or td.NO_WINDOW),
        td.LOG2E / math.sqrt(head_dim), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        H=n_heads, GROUP=group, BLOCK_R=block_r, BLOCK_N=cfg["block_n"], D=head_dim,
        IEEE=dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out = torch.empty(n_tokens, n_heads * head_dim, device=dev, dtype=dtype)
    dc = min(head_dim, td.combine_chunk(n_splits, head_dim, 4096))
    _chunk_combine_kernel[(n_tokens * n_heads, head_dim // dc)](
        o_part, lse, out, n_splits, n_tokens * n_heads, D=head_dim, BLOCK_S=triton.next_power_of_2(n_splits), DC=dc,
        num_warps=4)
    return out
