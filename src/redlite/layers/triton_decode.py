"""Triton kernels of the one-token decode step (CUDA; importable only where Triton is).

Each kernel replaces a chain of small torch ops and reads the position from a device tensor
(no host value baked in but the shapes), so one captured graph serves every position:

* ``decode_attention``: the whole attention of one token but its two projections, in one
  launch: q/k RMSNorm (Qwen3) and rotary at ``pos``, k and v written into the KV cache, then
  split-KV ("flash decoding") attention over keys ``0..pos`` (or the last ``window``), each
  program one KV head (its query heads as the rows of a small matrix product) and one slice
  of the keys; the last program of a KV head to finish combines the slices (a second launch
  does when that is much data: many slices of wide heads).
* ``add_rms_norm``: ``x += delta`` (rounded to x's dtype), then RMSNorm of x, and
  ``silu_mul``: ``silu(gate) * up`` of the fused gate/up row; used when the matrix-vector
  products are cuBLAS's (with Triton's, :mod:`redlite.layers.triton_gemv` fuses both in).

With ``pdl`` (1 or 2, see :func:`redlite.layers.triton_gemv.pdl_sync`) every kernel is
launched with programmatic dependent launch and waits for the previous one
(``griddepcontrol.wait``) before it reads or writes anything.

The rounding follows the torch reference ops in :mod:`redlite.layers.decode_ops` (the eager
model) step by step: statistics in float32, results rounded to the model dtype where torch
rounds them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from redlite.layers.triton_gemv import pdl_sync

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 40  # the window of full attention (keeps the kernel free of branches)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_sync(PDL)
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
def _norm_rope(base, rows, rmask, row_stride, nw_ptr, nw_rows, c, s, eps, D: tl.constexpr, R: tl.constexpr,
               HAS_NORM: tl.constexpr, ZC: tl.constexpr, dt: tl.constexpr):
    """Heads ``rows`` ([G]) of the projection at ``base`` (head ``r`` at ``base + r *
    row_stride``, D features): per-head RMSNorm (weight rows ``nw_rows`` of ``nw_ptr``
    [rows, D]; ``ZC``: the zero-centred form, scale ``1 + w`` in float32) when ``HAS_NORM``,
    then rotary with ``c``/``s`` ([D]; the first R features rotate). Returns [G, D] in ``dt``,
    rounded as :func:`redlite.layers.rotary.apply_rotary` and the norms of
    :mod:`redlite.layers.norm` round."""
    d = tl.arange(0, D)
    rot = d < R
    swap = tl.where(d < R // 2, d + R // 2, d - R // 2)
    x = tl.load(base + rows[:, None] * row_stride + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    xs = tl.load(base + rows[:, None] * row_stride + swap[None, :], mask=rmask[:, None] & rot[None, :],
                 other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(nw_ptr + nw_rows[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        ws = tl.load(nw_ptr + nw_rows[:, None] * D + swap[None, :], mask=rmask[:, None] & rot[None, :],
                     other=0.0).to(tl.float32)
        if ZC:
            x = (x * rstd[:, None] * (1.0 + w)).to(dt).to(tl.float32)
            xs = (xs * rstd[:, None] * (1.0 + ws)).to(dt).to(tl.float32)
        else:
            x = (w * (x * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xs = (ws * (xs * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    a = (x * c[None, :]).to(dt).to(tl.float32)
    return tl.where(rot[None, :], a + xs * s[None, :], x).to(dt)


@triton.jit
def _decode_attention_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, nw_ptr, knw_ptr, k_ptr, v_ptr,
                             o_ptr, lse_ptr, count_ptr, out_ptr,
                             stride_cos, stride_kh, stride_kt, stride_vh, stride_vt, window, qk_scale, eps,
                             n_splits, H: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                             HAS_NORM: tl.constexpr, IEEE: tl.constexpr, BLOCK_S: tl.constexpr,
                             PDL: tl.constexpr, GATED: tl.constexpr = False, ZC: tl.constexpr = False,
                             NW_ROWS: tl.constexpr = 1, QS: tl.constexpr = 0, DC: tl.constexpr = 64,
                             COMBINE: tl.constexpr = True, base_ptr=None, layer_off=0, v_off=0, row_stride=0,
                             BATCHED: tl.constexpr = False):
    # GATED (Qwen3.5): each query head's D features are followed by D gate features, and the
    # output is multiplied by sigmoid(gate). NW_ROWS 1: one norm row per head (q rows in
    # nw_ptr, k rows in knw_ptr); 0: one row shared by the q heads and one by the k heads.
    # QS: distance between query heads in qkv (D, or 2 D when GATED).
    # BATCHED: program_id(2) is a sequence b with its own qkv row, position, outputs and cache
    # (keys at base_ptr[b] + layer_off elements, values v_off further).
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    if BATCHED:
        b = tl.program_id(2)
        qkv_ptr += b * row_stride
        pos_ptr += b
        k_ptr = tl.load(base_ptr + b).to(tl.pointer_type(k_ptr.dtype.element_ty)) + layer_off
        v_ptr = k_ptr + v_off
        o_ptr += b * n_splits * H * D
        lse_ptr += b * n_splits * H
        count_ptr += b * KV
        out_ptr += b * H * D
    pdl_sync(PDL)
    dt = out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr)
    n = pos + 1  # keys 0 .. pos are valid
    first = tl.maximum(n - window, 0)  # window: 2**40 for full attention
    per = tl.cdiv(tl.cdiv(n - first, n_splits), BLOCK_N) * BLOCK_N
    lo = first + split * per
    hi = tl.minimum(lo + per, n)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < R, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=d < R, other=0.0).to(tl.float32)
    q = _norm_rope(qkv_ptr, heads, gmask, QS, nw_ptr, heads * NW_ROWS, c, s, eps, D, R, HAS_NORM, ZC, dt)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    if (pos >= lo) & (pos < hi):  # this program reads key `pos`: write it (and its value) first
        one = g < 1
        k_row = _norm_rope(qkv_ptr + H * QS, kvh + g * 0, one, D, knw_ptr, (kvh + g * 0) * NW_ROWS, c, s, eps,
                           D, R, HAS_NORM, ZC, dt)
        v_row = tl.load(qkv_ptr + H * QS + (KV + kvh) * D + g[:, None] * 0 + d[None, :], mask=one[:, None],
                        other=0.0)
        tl.store(k_base + pos * stride_kt + g[:, None] * 0 + d[None, :], k_row, mask=one[:, None])
        tl.store(v_base + pos * stride_vt + g[:, None] * 0 + d[None, :], v_row, mask=one[:, None])
        tl.debug_barrier()
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cmask = cols < hi
        # keys loaded as [D, BLOCK_N] (transposed by the addressing) so the loads go through
        # shared memory and the loop is software-pipelined; values issued at the same time
        kt = tl.load(k_base + d[:, None] + cols[None, :] * stride_kt, mask=cmask[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + d[None, :], mask=cmask[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, kt, input_precision="ieee")
        else:
            sc = tl.dot(q, kt)
        sc = tl.where(cmask[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
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
    if COMBINE:  # the last program of this KV head to finish combines the slices
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + kvh, 1, sem="acq_rel")
        if done == n_splits - 1:
            active = tl.cdiv(n - first, per)
            for j in tl.static_range(GROUP):
                for d0 in tl.static_range(0, D, DC):
                    _combine_head(o_ptr, lse_ptr, qkv_ptr, out_ptr, kvh * GROUP + j, d0, active, H, D, QS,
                                  GATED, BLOCK_S, DC)
            tl.atomic_xchg(count_ptr + kvh, 0)


@triton.jit
def _combine_head(o_ptr, lse_ptr, qkv_ptr, out_ptr, head, d0, active, H: tl.constexpr, D: tl.constexpr,
                  QS: tl.constexpr, GATED: tl.constexpr, BLOCK_S: tl.constexpr, DC: tl.constexpr):
    """Features ``d0 .. d0 + DC`` of query head ``head``: the slices' partial outputs
    weighted by their log-sum-exp; only the first ``active`` slices hold keys."""
    dt = out_ptr.dtype.element_ty
    sp = tl.arange(0, BLOCK_S)
    smask = sp < active
    dc = tl.arange(0, DC)
    part_lse = tl.load(lse_ptr + sp * H + head, mask=smask, other=float("-inf"), cache_modifier=".cg")
    w = tl.exp2(part_lse - tl.max(part_lse, axis=0))
    part = tl.load(o_ptr + (sp[:, None] * H + head) * D + d0 + dc[None, :], mask=smask[:, None],
                   other=0.0, cache_modifier=".cg")
    res = (tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)).to(dt)
    if GATED:
        gate = tl.load(qkv_ptr + head * QS + D + d0 + dc).to(tl.float32)
        res = (res.to(tl.float32) * (1.0 / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + head * D + d0 + dc, res)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, qkv_ptr, pos_ptr, out_ptr, window, n_splits, H: tl.constexpr,
                    D: tl.constexpr, QS: tl.constexpr, GATED: tl.constexpr, BLOCK_S: tl.constexpr,
                    DC: tl.constexpr, BLOCK_N: tl.constexpr, row_stride=0, BATCHED: tl.constexpr = False):
    # the split combine as its own launch: one program per (query head, DC features[, sequence])
    if BATCHED:
        b = tl.program_id(2)
        o_ptr += b * n_splits * H * D
        lse_ptr += b * n_splits * H
        qkv_ptr += b * row_stride
        pos_ptr += b
        out_ptr += b * H * D
    n = tl.load(pos_ptr) + 1
    first = tl.maximum(n - window, 0)
    per = tl.cdiv(tl.cdiv(n - first, n_splits), BLOCK_N) * BLOCK_N
    _combine_head(o_ptr, lse_ptr, qkv_ptr, out_ptr, tl.program_id(0), tl.program_id(1) * DC,
                  tl.cdiv(n - first, per), H, D, QS, GATED, BLOCK_S, DC)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_sync(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(dt), mask=mask)


# --- launchers -------------------------------------------------------------------------------

def _pdl(pdl: int) -> dict:
    """Launch options of a kernel launched with programmatic dependent launch (``pdl``): the
    kernel itself waits (``griddepcontrol.wait``) before touching any activation."""
    return {"launch_pdl": True} if pdl else {}


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 pdl: int = 0) -> torch.Tensor:
    """``x`` ([T, n] contiguous) ``+= delta`` in place (when given), then return
    ``rms_norm(x, weight, eps)`` as a new [T, n] tensor of x's dtype. ``pdl``: launch with
    programmatic dependent launch (see :mod:`redlite.layers.triton_gemv`)."""
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    _add_rms_norm_kernel[(rows,)](x, x if delta is None else delta, weight, out, n_cols, eps,
                                  HAS_DELTA=delta is not None, BLOCK=block, PDL=int(pdl),
                                  num_warps=8 if block >= 4096 else 4, **_pdl(pdl))
    return out


# H200, Qwen3-8B shape, 32k keys, one layer (bench/gpu_tune.py --quick, two machines,
# 2026-11-29, measured on the earlier two-kernel attention: split kernel + combine kernel):
# stages 2 / 33 splits 47.1 and 44.0 us, stages 3 / 33 splits 39.9 and 41.3 us (2.9-3.4 TB/s);
# 66 splits, block_n 128 or 8 warps were no better on the second machine. Not re-swept for the
# one-kernel attention (its 32k decode is 86% of the bandwidth bound in bench/results/).
ATTN_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 3, "splits_per_sm": 2,
               # the most partial-output floats (query heads per KV head x splits x head size) the
               # last program of a KV head combines itself; above it a second launch does, spread
               # over (head, features) programs. 0: always the second launch, faster for every
               # shape and context measured (bench/results/attn-combine-2026-12-02-nvidia-h200.md)
               "combine_in_kernel_max": 0}
# Per head size, where other settings measured faster (bench/hybrid_tune.py; its output is in
# bench/results/hybrid-tune-*); missing keys come from ATTN_CONFIG.
ATTN_CONFIGS_BY_DIM: dict[int, dict] = {256: {"block_n": 32, "num_warps": 4, "num_stages": 2}}


def attn_config(head_dim: int | None = None) -> dict:
    """The attention launch settings for ``head_dim`` (``ATTN_CONFIG`` overridden by
    ``ATTN_CONFIGS_BY_DIM[head_dim]``)."""
    return {**ATTN_CONFIG, **ATTN_CONFIGS_BY_DIM.get(head_dim, {})}


def default_splits(device: torch.device, n_kv_heads: int, head_dim: int | None = None) -> int:
    """Key slices per KV head: ``splits_per_sm`` (of :func:`attn_config`) programs per
    multiprocessor over all KV heads (at least 1, at most 128)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(128, math.ceil(attn_config(head_dim)["splits_per_sm"] * sms / n_kv_heads)))


def decode_attention(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     norm_weight: torch.Tensor | None, eps: float, keys: torch.Tensor, values: torch.Tensor,
                     n_heads: int, n_kv_heads: int, head_dim: int, window: int | None, n_splits: int,
                     counters: torch.Tensor, block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, pdl: int = 0, gated: bool = False,
                     k_norm_weight: torch.Tensor | None = None, combine_in_kernel: bool | None = None) -> torch.Tensor:
    """Attention of one token in one kernel launch: from its fused projection ``qkv`` [1,
    (H + 2 KV) * D] (see :meth:`redlite.layers.decode_ops.TorchDecodeOps.rope_attend`: q/k
    RMSNorm with ``norm_weight`` [H + KV, D] when given, rotary at ``pos`` from the tables
    ``cos``/``sin`` [positions, 1, rotary_dim], k and v written into ``keys``/``values`` [KV,
    max_tokens, D] at ``pos``), over rows ``0..pos`` (or the last ``window``). ``pos``:
    LongTensor [1] on the device. Returns [H, D] in qkv's dtype; scale ``1/sqrt(D)``.

    Split-KV ("flash decoding"): ``n_splits`` programs per KV head each take a slice of the
    keys, and the last of them to finish (counted in ``counters``, int32 [KV] zeros, reset by
    the kernel) combines the slices. ``block_n`` (keys per step), ``num_warps``,
    ``num_stages``: launch settings, default :func:`attn_config`. ``combine_in_kernel``: the
    last program combines (one launch), else a second launch does; default by
    ``combine_in_kernel_max`` of :func:`attn_config`. ``pdl``: programmatic dependent
    launch (see :mod:`redlite.layers.triton_gemv`).

    Qwen3.5 gated attention (``gated``): ``qkv`` is [1, (2H + 2 KV) * D] with each query
    head's D features followed by its D gate features; the zero-centred norm
    (``x * rstd * (1 + w)``) is used with ``norm_weight`` [D] for every q head and
    ``k_norm_weight`` [D] for every k head; the output is multiplied by ``sigmoid(gate)``
    (rounded as :class:`redlite.layers.gated_attention.GatedAttention` rounds).
    """
    config = attn_config(head_dim)
    block_n = block_n or config["block_n"]
    num_warps = num_warps or config["num_warps"]
    num_stages = num_stages or config["num_stages"]
    group = n_heads // n_kv_heads
    o_part = torch.empty(n_splits, n_heads, head_dim, device=qkv.device, dtype=torch.float32)
    lse = torch.empty(n_splits, n_heads, device=qkv.device, dtype=torch.float32)
    out = torch.empty(n_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    block_s = triton.next_power_of_2(n_splits)
    if combine_in_kernel is None:
        combine_in_kernel = group * block_s * head_dim <= config["combine_in_kernel_max"]
    if gated:
        knw = k_norm_weight
    else:  # the k rows follow the q rows of the per-head norm weight
        knw = qkv if norm_weight is None else norm_weight[n_heads:]
    _decode_attention_kernel[(n_kv_heads, n_splits)](
        qkv, pos, cos, sin, qkv if norm_weight is None else norm_weight, knw, keys, values, o_part, lse, counters,
        out, cos.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        int(window or NO_WINDOW), LOG2E / math.sqrt(head_dim), float(eps), n_splits, H=n_heads, KV=n_kv_heads,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, D=head_dim,
        R=cos.shape[-1], HAS_NORM=norm_weight is not None, IEEE=qkv.dtype == torch.float32,
        BLOCK_S=block_s, PDL=int(pdl), GATED=bool(gated), ZC=bool(gated),
        NW_ROWS=0 if gated else 1, QS=(2 if gated else 1) * head_dim, DC=combine_chunk(n_splits, head_dim),
        COMBINE=bool(combine_in_kernel), num_warps=num_warps, num_stages=num_stages, **_pdl(pdl))
    if not combine_in_kernel:
        dc = min(head_dim, combine_chunk(n_splits, head_dim, 4096))
        _combine_kernel[(n_heads, head_dim // dc)](
            o_part, lse, qkv, pos, out, int(window or NO_WINDOW), n_splits, H=n_heads, D=head_dim,
            QS=(2 if gated else 1) * head_dim, GATED=bool(gated), BLOCK_S=block_s, DC=dc, BLOCK_N=block_n,
            num_warps=4)
    return out


def combine_chunk(n_splits: int, head_dim: int, max_elements: int = 8192) -> int:
    """Features per step of the split combine: the [splits, features] float32 tile of one query
    head holds at most ``max_elements`` (the whole head when it fits), so it stays in registers
    instead of spilling (a 128-split, 256-wide head is 32k floats)."""
    fits = max(1, max_elements // triton.next_power_of_2(n_splits))
    return max(16, min(head_dim, triton.next_power_of_2(fits)))


def silu_mul(gate_up: torch.Tensor, inter: int, pdl: int = 0) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` ([T, 2*inter] contiguous) -> [T, inter]."""
    rows = gate_up.shape[0]
    out = torch.empty(rows, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, PDL=int(pdl),
                                                            num_warps=4, **_pdl(pdl))
    return out
