"""The one-token step of a Gated DeltaNet layer in one Triton kernel (CUDA; importable only
where Triton is).

Between the layer's input projection and its output projection
(:meth:`redlite.layers.gated_deltanet.GatedDeltaNet.mix` is the torch reference), one launch
of ``Hv x Dv / block_v`` programs, one per (value head, block of ``block_v`` value columns;
the delta rule is independent per state column), each doing:

* the causal conv1d of its key head's q and k channels (every program of the key head
  computes them) and of its own v channels over the conv state plus the new input, SiLU;
  the v conv-state update (shift left, the new input last) of its own channels;
* q/k L2 normalisation (q scaled by ``Dk ** -0.5``), ``beta = sigmoid(b)``,
  ``g = -exp(A_log) * softplus(a + dt_bias)``;
* the gated delta rule step on its ``[Dk, block_v]`` columns of the float32 state (read
  once, written once): ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q``;
* the gated RMSNorm ``rmsnorm(o) * norm_weight * silu(z)`` over the head's whole ``o``,
  written in the model dtype (the input of the output projection): by the program itself
  when ``block_v == Dv``, else the head's ``o`` goes through a float32 buffer.

The last program of a key head to finish (counted in an int32 counter per key head, which it
resets) writes the key head's q/k conv-state update, after every program of the key head has
read the old window, and does the gated norms when ``block_v < Dv``. With ``pdl`` the states
and weights are read before waiting for the previous kernel: only this layer's step writes
its states, and the kernel before it never is that step. Rounding follows the torch
reference step by step (the conv's products and sum, and the SiLU, in the model dtype;
everything after it in float32).

:func:`gdn_step_batch` runs the same kernel over B sequences (a third grid axis), each
finding its states through a table of addresses, so one CUDA graph serves any set of slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from redlite.layers.triton_gemv import pdl_sync


@triton.jit
def _tap(ptr, ch, stride: tl.constexpr, t: tl.constexpr, n: tl.constexpr):
    """Column ``t`` of rows ``ch`` of a [C, stride] table when ``t < n``, else zeros."""
    if t < n:
        return tl.load(ptr + ch * stride + t)
    else:
        return tl.zeros(ch.shape, ptr.dtype.element_ty)


@triton.jit
def _conv_load(cs_ptr, cw_ptr, ch, KW: tl.constexpr):
    """The conv history (taps 0..2, oldest first) and weights (taps 0..3) of channels ``ch``
    as vectors (KW <= 4; taps past the conv read nothing)."""
    return (_tap(cs_ptr, ch, KW - 1, 0, KW - 1), _tap(cs_ptr, ch, KW - 1, 1, KW - 1),
            _tap(cs_ptr, ch, KW - 1, 2, KW - 1), _tap(cw_ptr, ch, KW, 0, KW), _tap(cw_ptr, ch, KW, 1, KW),
            _tap(cw_ptr, ch, KW, 2, KW), _tap(cw_ptr, ch, KW, 3, KW))


@triton.jit
def _mul(a, w, dt: tl.constexpr):
    return (a.to(tl.float32) * w.to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _conv_silu(x, hist, KW: tl.constexpr, dt: tl.constexpr):
    """Conv output (SiLU applied, float32 of the model-dtype value) of new inputs ``x`` over
    ``hist`` from :func:`_conv_load` (the products and their sum rounded to ``dt``)."""
    h0, h1, h2, w0, w1, w2, w3 = hist
    if KW == 2:
        y = _mul(h0, w0, dt) + _mul(x, w1, dt)
    elif KW == 3:
        y = _mul(h0, w0, dt) + _mul(h1, w1, dt) + _mul(x, w2, dt)
    else:
        y = _mul(h0, w0, dt) + _mul(h1, w1, dt) + _mul(h2, w2, dt) + _mul(x, w3, dt)
    y = y.to(dt).to(tl.float32)
    return (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)


@triton.jit
def _store_state(cs_ptr, ch, x, hist, KW: tl.constexpr):
    """The conv state of channels ``ch`` shifted one tap left, the new input ``x`` last."""
    h0, h1, h2, w0, w1, w2, w3 = hist
    base = cs_ptr + ch * (KW - 1)
    if KW == 2:
        tl.store(base, x)
    elif KW == 3:
        tl.store(base, h1)
        tl.store(base + 1, x)
    else:
        tl.store(base, h1)
        tl.store(base + 1, h2)
        tl.store(base + 2, x)


@triton.jit
def _gated_norm(o, h, proj_ptr, nw_ptr, out_ptr, eps, CONV_DIM: tl.constexpr, DV: tl.constexpr):
    """Value head ``h``'s whole output ``o`` [DV] (float32) -> ``rmsnorm(o) * w * silu(z)``."""
    vv = tl.arange(0, DV)
    o = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
    z = tl.load(proj_ptr + CONV_DIM + h * DV + vv).to(tl.float32)
    o = o * tl.load(nw_ptr + vv).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + h * DV + vv, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _gdn_step_kernel(proj_ptr, cs_ptr, cw_ptr, alog_ptr, dtb_ptr, state_ptr, nw_ptr, out_ptr, o_ptr, count_ptr,
                     eps, q_scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     BLOCK_V: tl.constexpr, KW: tl.constexpr, PDL: tl.constexpr, conv_base=None, rec_base=None,
                     conv_off=0, rec_off=0, row_stride=0, BATCHED: tl.constexpr = False,
                     ALIGNED: tl.constexpr = False):
    h = tl.program_id(0)
    G: tl.constexpr = HV // HK
    NVB: tl.constexpr = DV // BLOCK_V
    kh = h // G
    dt = out_ptr.dtype.element_ty
    KEY_DIM: tl.constexpr = HK * DK
    CONV_DIM: tl.constexpr = 2 * HK * DK + HV * DV
    if BATCHED:  # program_id(2): sequence b, its proj row, outputs, counters, and states by address
        seq = tl.program_id(2)
        cs_ptr = tl.load(conv_base + seq).to(tl.pointer_type(cs_ptr.dtype.element_ty)) + conv_off
        state_ptr = tl.load(rec_base + seq).to(tl.pointer_type(tl.float32)) + rec_off
        proj_ptr += seq * row_stride
        if ALIGNED:  # 16-byte aligned, as a tensor argument is known to be: the lone step's load layouts
            cs_ptr = tl.multiple_of(cs_ptr, 16)
            state_ptr = tl.multiple_of(state_ptr, 16)
            proj_ptr = tl.multiple_of(proj_ptr, 16)
        out_ptr += seq * (HV * DV)
        o_ptr += seq * (HV * DV)
        count_ptr += seq * HK
    kk = tl.arange(0, DK)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    q_ch = kh * DK + kk
    k_ch = KEY_DIM + kh * DK + kk
    v_ch = 2 * KEY_DIM + h * DV + vv
    # states and weights: nothing the previous kernel writes (see the module docstring)
    s_ptrs = state_ptr + h * DK * DV + kk[:, None] * DV + vv[None, :]
    s = tl.load(s_ptrs)
    q_hist = _conv_load(cs_ptr, cw_ptr, q_ch, KW)
    k_hist = _conv_load(cs_ptr, cw_ptr, k_ch, KW)
    v_hist = _conv_load(cs_ptr, cw_ptr, v_ch, KW)
    decay_rate = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    pdl_sync(PDL)
    q_x = tl.load(proj_ptr + q_ch)
    k_x = tl.load(proj_ptr + k_ch)
    v_x = tl.load(proj_ptr + v_ch)
    q = _conv_silu(q_x, q_hist, KW, dt)
    k = _conv_silu(k_x, k_hist, KW, dt)
    v = _conv_silu(v_x, v_hist, KW, dt)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    b = tl.load(proj_ptr + CONV_DIM + HV * DV + h).to(tl.float32)
    a = tl.load(proj_ptr + CONV_DIM + HV * DV + HV + h).to(tl.float32) + dt_bias
    beta = 1.0 / (1.0 + tl.exp(-b))
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    s = s * tl.exp(decay_rate * softplus)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptrs, s)
    o = tl.sum(s * q[:, None], axis=0)
    if NVB == 1:
        _gated_norm(o, h, proj_ptr, nw_ptr, out_ptr, eps, CONV_DIM, DV)
    else:
        tl.store(o_ptr + h * DV + vv, o)
    tl.debug_barrier()  # every old conv value is read before any is overwritten
    _store_state(cs_ptr, v_ch, v_x, v_hist, KW)  # this program's own channels
    if G * NVB == 1:
        _store_state(cs_ptr, q_ch, q_x, q_hist, KW)
        _store_state(cs_ptr, k_ch, k_x, k_hist, KW)
    else:  # the key head's last program to finish: the old q/k window is read by all
        done = tl.atomic_add(count_ptr + kh, 1, sem="acq_rel")
        if done == G * NVB - 1:
            _store_state(cs_ptr, q_ch, q_x, q_hist, KW)
            _store_state(cs_ptr, k_ch, k_x, k_hist, KW)
            if NVB > 1:
                for j in tl.static_range(G):
                    hh = kh * G + j
                    o_all = tl.load(o_ptr + hh * DV + tl.arange(0, DV), cache_modifier=".cg")
                    _gated_norm(o_all, hh, proj_ptr, nw_ptr, out_ptr, eps, CONV_DIM, DV)
            tl.atomic_xchg(count_ptr + kh, 0)


#: value columns per program (capped at Dv) and warps per program: the fastest in
#: bench/hybrid_tune.py's sweep (bench/results/hybrid-tune-*)
GDN_BLOCK_V = 32
GDN_WARPS = 4
MAX_KEY_HEADS = 1024


def supported(num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int,
              conv_kernel_size: int) -> bool:
    """True when :func:`gdn_step` takes these shapes: power-of-two head dims >= 16, a conv of
    width 2 to 4, value heads a multiple of key heads, at most ``MAX_KEY_HEADS`` key heads."""
    def pow2(n):
        return n >= 16 and n & (n - 1) == 0
    return (pow2(key_head_dim) and pow2(value_head_dim) and 2 <= conv_kernel_size <= 4
            and num_value_heads % num_key_heads == 0 and num_key_heads <= MAX_KEY_HEADS)


def gdn_step(proj: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, mixer,
             pdl: int = 0, num_warps: int | None = None, block_v: int | None = None,
             counters: torch.Tensor | None = None) -> torch.Tensor:
    """One token through the Gated DeltaNet layer ``mixer`` between its two projections.

    ``proj``: [1, C + Hv*Dv + 2*Hv] (the input projection's output: q, k, v, z, b, a),
    contiguous; ``conv_state`` [C, K - 1] (model dtype) and ``recurrent_state`` [Hv, Dk, Dv]
    (float32), both contiguous and updated in place. Returns [1, Hv*Dv] in proj's dtype: the
    gated-normalised output, ready for ``out_proj``. ``pdl``: programmatic dependent launch
    (see :mod:`redlite.layers.triton_gemv`); the kernel launched just before must not write
    the states. ``block_v`` (a power of two) and ``num_warps``: default ``GDN_BLOCK_V`` and
    ``GDN_WARPS``. ``counters``: int32 zeros, at least one per key head, that the kernel
    leaves zero (keep one per device for graphs); None: fresh zeros. Shapes must pass
    :func:`supported`.
    """
    m = mixer
    dv = m.value_head_dim
    block_v = min(block_v or GDN_BLOCK_V, dv)
    if counters is None:
        counters = torch.zeros(m.num_key_heads, dtype=torch.int32, device=proj.device)
    out = torch.empty(1, m.value_dim, device=proj.device, dtype=proj.dtype)
    o_full = out if block_v == dv else torch.empty(m.value_dim, device=proj.device, dtype=torch.float32)
    extra = {"launch_pdl": True} if pdl else {}
    _gdn_step_kernel[(m.num_value_heads, dv // block_v)](
        proj, conv_state, m.conv_weight, m.A_log, m.dt_bias, recurrent_state, m.norm_weight, out, o_full,
        counters, float(m.eps), m.key_head_dim ** -0.5, HK=m.num_key_heads, HV=m.num_value_heads,
        DK=m.key_head_dim, DV=dv, BLOCK_V=block_v, KW=m.conv_kernel_size, PDL=int(pdl), num_warps=num_warps or GDN_WARPS,
        **extra)
    return out


def gdn_step_batch(proj: torch.Tensor, conv_bases: torch.Tensor, rec_bases: torch.Tensor, conv_off: int,
                   rec_off: int, like_conv: torch.Tensor, mixer, pdl: int = 0, counters: torch.Tensor | None = None,
                   num_warps: int | None = None, block_v: int | None = None) -> torch.Tensor:
    """:func:`gdn_step` of B sequences in one launch: row b of ``proj`` [B, width] (rows
    contiguous) over the conv and recurrent states of sequence b, found by address:
    ``conv_bases[b] + conv_off`` elements of ``like_conv``'s dtype and ``rec_bases[b] +
    rec_off`` float32 elements (int64 ``[B]`` tables on the device, rows 1 and 2 of
    :func:`~redlite.models.slot_table.slot_table`; offsets from ``layer_offsets``), updated in
    place. Each row is computed as :func:`gdn_step` computes it alone, bitwise when every
    state and ``proj`` row starts 16-byte aligned (the kernel is then told so and loads as the
    lone kernel does; the buffers of real shapes are), else to float rounding. Returns
    [B, Hv*Dv] in proj's dtype. ``counters``: int32 zeros, at least B x key heads, left zero
    (None or too few: fresh zeros). Other arguments as :func:`gdn_step`."""
    m = mixer
    batch, dv = proj.shape[0], m.value_head_dim
    if conv_bases.numel() != batch or rec_bases.numel() != batch or proj.stride(-1) != 1:
        raise ValueError(f"batched GDN step: proj {tuple(proj.shape)}, tables {conv_bases.numel()}, "
                         f"{rec_bases.numel()}")
    block_v = min(block_v or GDN_BLOCK_V, dv)
    if counters is None or counters.numel() < batch * m.num_key_heads:
        counters = torch.zeros(batch * m.num_key_heads, dtype=torch.int32, device=proj.device)
    out = torch.empty(batch, m.value_dim, device=proj.device, dtype=proj.dtype)
    o_full = out if block_v == dv else torch.empty(batch, m.value_dim, device=proj.device, dtype=torch.float32)
    extra = {"launch_pdl": True} if pdl else {}
    aligned = (proj.data_ptr() % 16 == 0 and proj.stride(0) * proj.element_size() % 16 == 0
               and conv_off * like_conv.element_size() % 16 == 0 and rec_off * 4 % 16 == 0)
    _gdn_step_kernel[(m.num_value_heads, dv // block_v, batch)](
        proj, like_conv, m.conv_weight, m.A_log, m.dt_bias, like_conv, m.norm_weight, out, o_full,
        counters, float(m.eps), m.key_head_dim ** -0.5, HK=m.num_key_heads, HV=m.num_value_heads,
        DK=m.key_head_dim, DV=dv, BLOCK_V=block_v, KW=m.conv_kernel_size, PDL=int(pdl),
        conv_base=conv_bases, rec_base=rec_bases, conv_off=int(conv_off), rec_off=int(rec_off),
        row_stride=proj.stride(0), BATCHED=True, ALIGNED=aligned, num_warps=num_warps or GDN_WARPS, **extra)
    return out
