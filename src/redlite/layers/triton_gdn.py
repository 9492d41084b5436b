"""The one-token step of a Gated DeltaNet layer in one Triton kernel (CUDA; importable only
where Triton is).

Between the layer's input projection and its output projection
(:meth:`redlite.layers.gated_deltanet.GatedDeltaNet.mix` is the torch reference), one launch
does, per key head (one program each):

* the causal conv1d of the head's q, k and v channels over the conv state plus the new
  input, SiLU, and the conv-state update (shift left, the new input last);
* q/k L2 normalisation (q scaled by ``Dk ** -0.5``), ``beta = sigmoid(b)``,
  ``g = -exp(A_log) * softplus(a + dt_bias)``;
* for each of the key head's value heads, the gated delta rule step on the float32 state
  ``[Dk, Dv]`` (read once, written once): ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``,
  ``o = S^T q``;
* the gated RMSNorm ``rmsnorm(o) * norm_weight * silu(z)``, written in the model dtype
  (the input of the output projection, whose residual add is the gemv kernel's epilogue).

One program per key head owns that head's q/k conv channels, so the conv-state update needs
no cross-program ordering. Rounding follows the torch reference step by step (the conv's
products and sum, and the SiLU, in the model dtype; everything after it in float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from redlite.layers.triton_gemv import pdl_sync


@triton.jit
def _conv_silu(proj_ptr, cs_ptr, cw_ptr, ch, KW: tl.constexpr, KP: tl.constexpr, dt: tl.constexpr):
    """Conv outputs (SiLU applied, float32 of the model-dtype value) of channels ``ch`` and
    the shifted window to store back as their conv state ([len(ch), KP], taps < KW - 1)."""
    t = tl.arange(0, KP)
    hist = t < KW - 1
    x_new = tl.load(proj_ptr + ch)
    old = tl.load(cs_ptr + ch[:, None] * (KW - 1) + t[None, :], mask=hist[None, :], other=0.0)
    window = tl.where(hist[None, :], old, x_new[:, None])  # taps 0 .. KW-1, newest last
    w = tl.load(cw_ptr + ch[:, None] * KW + t[None, :], mask=(t < KW)[None, :], other=0.0)
    prod = (window.to(tl.float32) * w.to(tl.float32)).to(dt).to(tl.float32)
    prod = tl.where((t < KW)[None, :], prod, 0.0)
    y = tl.sum(prod, axis=1).to(dt).to(tl.float32)
    act = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)
    nxt = tl.load(cs_ptr + ch[:, None] * (KW - 1) + t[None, :] + 1, mask=(t < KW - 2)[None, :], other=0.0)
    shifted = tl.where((t < KW - 2)[None, :], nxt, x_new[:, None])
    return act, shifted


@triton.jit
def _store_state(cs_ptr, ch, shifted, KW: tl.constexpr, KP: tl.constexpr):
    t = tl.arange(0, KP)
    tl.store(cs_ptr + ch[:, None] * (KW - 1) + t[None, :], shifted, mask=(t < KW - 1)[None, :])


@triton.jit
def _gdn_step_kernel(proj_ptr, cs_ptr, cw_ptr, alog_ptr, dtb_ptr, state_ptr, nw_ptr, out_ptr, eps, q_scale,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     KW: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    kh = tl.program_id(0)
    pdl_sync(PDL)
    dt = out_ptr.dtype.element_ty
    KEY_DIM = HK * DK
    CONV_DIM = 2 * HK * DK + HV * DV
    kk = tl.arange(0, DK)
    vv = tl.arange(0, DV)
    q_ch = kh * DK + kk
    k_ch = KEY_DIM + kh * DK + kk
    q, q_next = _conv_silu(proj_ptr, cs_ptr, cw_ptr, q_ch, KW, KP, dt)
    k, k_next = _conv_silu(proj_ptr, cs_ptr, cw_ptr, k_ch, KW, KP, dt)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    for j in tl.static_range(HV // HK):
        h = kh * (HV // HK) + j
        v_ch = 2 * KEY_DIM + h * DV + vv
        v, v_next = _conv_silu(proj_ptr, cs_ptr, cw_ptr, v_ch, KW, KP, dt)
        tl.debug_barrier()  # every old conv value is read before any is overwritten
        _store_state(cs_ptr, v_ch, v_next, KW, KP)
        b = tl.load(proj_ptr + CONV_DIM + HV * DV + h).to(tl.float32)
        a = tl.load(proj_ptr + CONV_DIM + HV * DV + HV + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-b))
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        decay = tl.exp(-tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus)
        s_ptrs = state_ptr + h * DK * DV + kk[:, None] * DV + vv[None, :]
        s = tl.load(s_ptrs) * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(s_ptrs, s)
        o = tl.sum(s * q[:, None], axis=0)
        o = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)
        z = tl.load(proj_ptr + CONV_DIM + h * DV + vv).to(tl.float32)
        o = o * tl.load(nw_ptr + vv).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
        tl.store(out_ptr + h * DV + vv, o.to(dt))
    _store_state(cs_ptr, q_ch, q_next, KW, KP)
    _store_state(cs_ptr, k_ch, k_next, KW, KP)


# warps per program, the fastest in bench/hybrid_tune.py's sweep (bench/results/hybrid-tune-*)
GDN_WARPS = 4


def supported(num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int,
              conv_kernel_size: int) -> bool:
    """True when :func:`gdn_step` takes these shapes: power-of-two head dims >= 16, a conv of
    width >= 2, and value heads a multiple of key heads."""
    def pow2(n):
        return n >= 16 and n & (n - 1) == 0
    return (pow2(key_head_dim) and pow2(value_head_dim) and conv_kernel_size >= 2
            and num_value_heads % num_key_heads == 0)


def gdn_step(proj: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, mixer,
             pdl: int = 0, num_warps: int | None = None) -> torch.Tensor:
    """One token through the Gated DeltaNet layer ``mixer`` between its two projections.

    ``proj``: [1, C + Hv*Dv + 2*Hv] (the input projection's output: q, k, v, z, b, a),
    contiguous; ``conv_state`` [C, K - 1] (model dtype) and ``recurrent_state`` [Hv, Dk, Dv]
    (float32), both contiguous and updated in place. Returns [1, Hv*Dv] in proj's dtype: the
    gated-normalised output, ready for ``out_proj``. ``pdl``: programmatic dependent launch
    (see :mod:`redlite.layers.triton_gemv`). ``num_warps``: default ``GDN_WARPS``. Shapes
    must pass :func:`supported`.
    """
    m = mixer
    out = torch.empty(1, m.value_dim, device=proj.device, dtype=proj.dtype)
    extra = {"launch_pdl": True} if pdl else {}
    _gdn_step_kernel[(m.num_key_heads,)](
        proj, conv_state, m.conv_weight, m.A_log, m.dt_bias, recurrent_state, m.norm_weight, out,
        float(m.eps), m.key_head_dim ** -0.5, HK=m.num_key_heads, HV=m.num_value_heads, DK=m.key_head_dim,
        DV=m.value_head_dim, KW=m.conv_kernel_size, KP=triton.next_power_of_2(m.conv_kernel_size),
        PDL=int(pdl), num_warps=num_warps or GDN_WARPS, **extra)
    return out
