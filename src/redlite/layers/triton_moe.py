"""The sparse mixture-of-experts block of one decode token in fused Triton kernels (CUDA;
importable only where Triton is).

:class:`~redlite.layers.moe.SparseMoE` for one token ``x`` (the residual stream, [1, H]) in
four launches, none of which reads anything on the host (the chosen experts' ids stay on the
device, so the step stays inside the CUDA graph):

* the router product: ``gates_weight`` [E + 1, H] times the normalised ``x``, one
  :func:`redlite.layers.triton_gemv.gemv` with the input norm fused in, giving the ``E``
  router logits and the shared expert's gate logit as float32;
* :func:`_route_kernel` (one program): softmax, top-k (one max per pick over keys packing
  the probability above the id), normalised top-k weights, and ``sigmoid`` of the shared
  gate, into a small routing buffer;
* :func:`_gate_up_kernel`: per row block of one chosen expert's fused gate/up weight (or of
  the shared expert's; one program each, or a fixed number striding over them),
  ``silu(gate) * up`` of the RMS-normalised ``x`` (norm fused in) into row ``slot`` of the
  activation buffer [k + 1, max(I, Is)] (the shared expert's is row ``k``; with PDL each
  program's first shared block is computed before it waits for the routing). Only the
  chosen experts' weights are read;
* :func:`_down_kernel`: per block of output rows, the routed experts' down products weighted
  by their routing weights (all experts' ids read at once, then one gather of every expert's
  rows per column step, so their loads are in flight together; with PDL the ids and the first
  gather are read before it waits for the gate/up kernel), plus the gated shared expert's,
  added to the residual in place.

Rounding follows the torch reference (:meth:`SparseMoE.forward` through
:meth:`redlite.layers.decode_ops.TorchDecodeOps.moe`): each product rounded to the model
dtype, the weighted routed sum accumulated in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from redlite.layers.triton_gemv import _load_tile, _row_block, _sm_count, _x_tile, gemv, pdl_sync

#: (block_n, block_k, num_warps, programs_per_sm) of the gate/up kernel (programs_per_sm 0:
#: one program per row block, else that many per multiprocessor stride over the blocks) and
#: (block_n, block_i, num_warps) of the down kernel (block_k / block_i: columns per step,
#: capped at the next power of two of the row length): the fastest of bench/moe_tune.py's
#: sweep on an H200 in the 35B-A3B shape (bench/results/moe-tune-2026-12-03-nvidia-h200.txt).
GATE_UP_CONFIG = (2, 2048, 4, 4)
DOWN_CONFIG = (2, 256, 2)
#: warps of the one-program routing kernel (its reductions span all of them)
ROUTE_WARPS = 1
#: route inside the gate/up kernel instead of a routing kernel of its own (see :func:`moe_step`)
ROUTE_IN_GATE_UP = False
#: the down kernel reads the routing and the chosen experts' first weight tiles before it waits
#: for the gate/up kernel (see :func:`moe_step`)
DOWN_EARLY = True
#: each gate/up program computes its first block of the shared expert before it waits for the
#: routing (see :func:`moe_step`)
GATE_UP_EARLY = True
MAX_EXPERTS = 1024
REGISTERS_PER_SM = 65536


@triton.jit
def _top_k(logits_ptr, E, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr,
           NORM_TOPK: tl.constexpr):
    """Expert ids [BLOCK_TK] int32 and routing weights [BLOCK_TK] float32 of the ``TOP_K``
    largest softmax probabilities (ties to the lower id); slots past ``TOP_K`` hold 0."""
    es = tl.arange(0, BLOCK_E)
    js = tl.arange(0, BLOCK_TK)
    logit = tl.load(logits_ptr + es, mask=es < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = p / tl.sum(p, axis=0)
    # one max per pick: a probability's bits (>= 0: ordered as integers) above the inverted id
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - es).to(tl.int64)
    key = tl.where(es < E, key, -1)
    ids = tl.zeros([BLOCK_TK], tl.int32)
    ws = tl.zeros([BLOCK_TK], tl.float32)
    for j in tl.static_range(TOP_K):
        top = tl.max(key, axis=0)
        ids = tl.where(js == j, BLOCK_E - 1 - (top & 0xFFFFFFFF).to(tl.int32), ids)
        ws = tl.where(js == j, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), ws)
        key = tl.where(key == top, -1, key)
    if NORM_TOPK:
        ws = ws / tl.sum(ws, axis=0)
    return ids, ws


@triton.jit
def _route_kernel(logits_ptr, route_ptr, E, TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_TK: tl.constexpr, PDL: tl.constexpr):
    # route_ptr (float32, 2 * BLOCK_TK + 1): expert ids, their weights, sigmoid(shared gate)
    pdl_sync(PDL)
    js = tl.arange(0, BLOCK_TK)
    ids, ws = _top_k(logits_ptr, E, BLOCK_E, TOP_K, BLOCK_TK, NORM_TOPK)
    _store_route(logits_ptr, route_ptr, E, ids, ws, js, BLOCK_TK)


@triton.jit
def _store_route(logits_ptr, route_ptr, E, ids, ws, js, BLOCK_TK: tl.constexpr):
    tl.store(route_ptr + js, ids.to(tl.float32))
    tl.store(route_ptr + BLOCK_TK + js, ws)
    g = tl.load(logits_ptr + E)
    tl.store(route_ptr + 2 * BLOCK_TK, 1.0 / (1.0 + tl.exp(-g)))


@triton.jit
def _gu_tile(gu_ptr, sgu_ptr, ids, js, block, n_blocks, nb_s, nb_r, H, I, IS, ks, TOP_K: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """First column tile of gate/up row block ``block`` (blocks [0, nb_s): the shared expert's,
    then TOP_K groups of nb_r routed ones; past ``n_blocks``: reads nothing), with its weight
    base, its row count, its row block within the expert and its activation row."""
    if block < nb_s:
        base = sgu_ptr + block * 0
        n = IS + block * 0
        rb = block
        slot = block * 0 + TOP_K
    else:
        r = block - nb_s
        slot = r // nb_r
        rb = r % nb_r
        expert = tl.sum(tl.where(js == slot, ids, 0), axis=0)
        base = gu_ptr + expert * 2 * I * H
        n = tl.where(block < n_blocks, I, 0)
    w, w_up = _load_tile(base, rb, n, H, 0, ks, BLOCK_N, 2)
    return w, w_up, base, n, rb, slot


@triton.jit
def _rstd(x_ptr, H, eps, ks, BLOCK_K: tl.constexpr, CG: tl.constexpr):
    """1 / RMS of the row ``x`` [H] (float32; ``CG``: read through L2)."""
    sumsq = tl.zeros(ks.shape, tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if CG:
            xs = tl.load(x_ptr + k0 + ks, mask=k0 + ks < H, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            xs = tl.load(x_ptr + k0 + ks, mask=k0 + ks < H, other=0.0).to(tl.float32)
        sumsq += xs * xs
    return 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / H + eps)


@triton.jit
def _gate_up_kernel(x_ptr, nw_ptr, route_ptr, gu_ptr, sgu_ptr, act_ptr, H, I, IS, IMAX, eps, nb_s, nb_r, n_blocks,
                    TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, ZC: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STRIDED: tl.constexpr, PDL: tl.constexpr, logits_ptr=None, E=0,
                    ROUTE: tl.constexpr = False, NORM_TOPK: tl.constexpr = False, BLOCK_E: tl.constexpr = 1,
                    EARLY: tl.constexpr = False):
    # one program per row block, or (STRIDED) programs stride over the blocks, each loading its
    # next block's first tile before working on the current one; the shared expert's first
    # tiles are read before waiting, and (EARLY: x is final before the wait) its first block
    # of each program is computed before waiting
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    ks = tl.arange(0, BLOCK_K)
    js = tl.arange(0, BLOCK_TK)
    dt = act_ptr.dtype.element_ty
    w, w_up = _load_tile(sgu_ptr, pid, IS, H, 0, ks, BLOCK_N, 2)  # rows past IS read nothing
    first = pid
    if EARLY:
        rstd = _rstd(x_ptr, H, eps, ks, BLOCK_K, True)
        x0 = _x_tile(x_ptr, nw_ptr, 0, ks, H, rstd, True, ZC, dt, True)
        if pid < nb_s:
            _row_block(w, w_up, x0, pid, sgu_ptr, x_ptr, nw_ptr, x_ptr, act_ptr + TOP_K * IMAX, IS, H, rstd, ks,
                       True, ZC, False, 2, False, BLOCK_N, BLOCK_K, dt, True)
            first = pid + step
    pdl_sync(PDL)
    if ROUTE:  # every program routes from the router logits; program 0 writes the routing for the down kernel
        ids32, ws = _top_k(logits_ptr, E, BLOCK_E, TOP_K, BLOCK_TK, NORM_TOPK)
        ids = ids32.to(tl.int64)
        if pid == 0:
            _store_route(logits_ptr, route_ptr, E, ids32, ws, js, BLOCK_TK)
    else:
        ids = tl.load(route_ptr + js, mask=js < TOP_K, other=0.0).to(tl.int64)
    if not EARLY:
        rstd = _rstd(x_ptr, H, eps, ks, BLOCK_K, False)
        x0 = _x_tile(x_ptr, nw_ptr, 0, ks, H, rstd, True, ZC, dt)
    base = sgu_ptr + pid * 0
    n = IS + pid * 0
    rb = pid
    slot = pid * 0 + TOP_K
    if (first >= nb_s) | (first != pid):
        w, w_up, base, n, rb, slot = _gu_tile(gu_ptr, sgu_ptr, ids, js, first, n_blocks, nb_s, nb_r, H, I, IS, ks,
                                              TOP_K, BLOCK_N)
    if STRIDED:
        for block in range(first, n_blocks, step):
            w_next, w_up_next, base_next, n_next, rb_next, slot_next = _gu_tile(
                gu_ptr, sgu_ptr, ids, js, block + step, n_blocks, nb_s, nb_r, H, I, IS, ks, TOP_K, BLOCK_N)
            _row_block(w, w_up, x0, rb, base, x_ptr, nw_ptr, x_ptr, act_ptr + slot * IMAX, n, H, rstd, ks,
                       True, ZC, False, 2, False, BLOCK_N, BLOCK_K, dt)
            w, w_up, base, n, rb, slot = w_next, w_up_next, base_next, n_next, rb_next, slot_next
    elif first < n_blocks:
        _row_block(w, w_up, x0, rb, base, x_ptr, nw_ptr, x_ptr, act_ptr + slot * IMAX, n, H, rstd, ks,
                   True, ZC, False, 2, False, BLOCK_N, BLOCK_K, dt)


@triton.jit
def _down_first(route_ptr, dw_ptr, js, jmask, rows, rmask, cs, H, I, EARLY: tl.constexpr):
    """The chosen experts' row offsets [BLOCK_TK, BLOCK_N, 1] (int64) and their first column
    tile of the down weight (``EARLY``: the routing read through L2, before the wait)."""
    if EARLY:
        experts = tl.load(route_ptr + js, mask=jmask, other=0.0, cache_modifier=".cg").to(tl.int64)
    else:
        experts = tl.load(route_ptr + js, mask=jmask, other=0.0).to(tl.int64)
    e_rows = (experts * H)[:, None, None] * I + rows.to(tl.int64)[None, :, None] * I
    w = tl.load(dw_ptr + e_rows + cs[None, None, :],
                mask=jmask[:, None, None] & rmask[None, :, None] & (cs < I)[None, None, :], other=0.0)
    return e_rows, w


@triton.jit
def _down_kernel(act_ptr, route_ptr, dw_ptr, sdw_ptr, out_ptr, H, I, IS, IMAX, TOP_K: tl.constexpr,
                 BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, PDL: tl.constexpr,
                 EARLY: tl.constexpr = False):
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    cs = tl.arange(0, BLOCK_I)
    js = tl.arange(0, BLOCK_TK)
    jmask = js < TOP_K
    # the shared expert's first tile does not depend on the routing: read it before waiting;
    # EARLY (the routing was complete before the previous kernel let this one launch): the
    # chosen experts' first tiles too
    s_rows = rows.to(tl.int64)[:, None] * IS
    sw = tl.load(sdw_ptr + s_rows + cs[None, :], mask=rmask[:, None] & (cs < IS)[None, :], other=0.0)
    if EARLY:
        e_rows, w = _down_first(route_ptr, dw_ptr, js, jmask, rows, rmask, cs, H, I, True)
    pdl_sync(PDL)
    if not EARLY:  # all experts' ids, then one [BLOCK_TK, BLOCK_N, BLOCK_I] gather per column step
        e_rows, w = _down_first(route_ptr, dw_ptr, js, jmask, rows, rmask, cs, H, I, False)
    weights = tl.load(route_ptr + BLOCK_TK + js, mask=jmask, other=0.0).to(dt).to(tl.float32)
    rjmask = jmask[:, None, None] & rmask[None, :, None]
    a = tl.load(act_ptr + js[:, None, None] * IMAX + cs[None, None, :],
                mask=jmask[:, None, None] & (cs < I)[None, None, :], other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * a, axis=2)
    for i0 in range(BLOCK_I, I, BLOCK_I):
        m = i0 + cs < I
        w = tl.load(dw_ptr + e_rows + i0 + cs[None, None, :], mask=rjmask & m[None, None, :], other=0.0)
        a = tl.load(act_ptr + js[:, None, None] * IMAX + i0 + cs[None, None, :],
                    mask=jmask[:, None, None] & m[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * a, axis=2)
    routed = tl.sum((acc.to(dt).to(tl.float32) * weights[:, None]).to(dt).to(tl.float32), axis=0)
    a = tl.load(act_ptr + TOP_K * IMAX + cs, mask=cs < IS, other=0.0).to(tl.float32)
    acc_s = tl.sum(sw.to(tl.float32) * a[None, :], axis=1)
    for i0 in range(BLOCK_I, IS, BLOCK_I):
        m = i0 + cs < IS
        sw = tl.load(sdw_ptr + s_rows + i0 + cs[None, :], mask=rmask[:, None] & m[None, :], other=0.0)
        a = tl.load(act_ptr + TOP_K * IMAX + i0 + cs, mask=m, other=0.0).to(tl.float32)
        acc_s += tl.sum(sw.to(tl.float32) * a[None, :], axis=1)
    gate = tl.load(route_ptr + 2 * BLOCK_TK).to(dt).to(tl.float32)
    shared = (acc_s.to(dt).to(tl.float32) * gate).to(dt).to(tl.float32)
    total = (routed.to(dt).to(tl.float32) + shared).to(dt).to(tl.float32)
    res = tl.load(out_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, (res + total).to(dt), mask=rmask)


def supported(moe) -> bool:
    """True when :func:`moe_step` takes this :class:`~redlite.layers.moe.SparseMoE`: at most
    ``MAX_EXPERTS`` experts, contiguous expert weights."""
    return (moe.num_experts <= MAX_EXPERTS and moe.gate_up_weight.is_contiguous()
            and moe.down_weight.is_contiguous() and moe.gates_weight.is_contiguous())


def moe_step(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, moe, zero_centered: bool = True,
             pdl: int = 0, gate_up_config: tuple[int, int, int, int] | None = None,
             down_config: tuple[int, int, int] | None = None, configs=None,
             route_warps: int | None = None, route_in_gate_up: bool | None = None,
             down_early: bool | None = None, gate_up_early: bool | None = None) -> torch.Tensor:
    """``x += moe(rms_norm(x))`` in place for one token: ``x`` [1, H] contiguous (the residual
    stream), ``norm_weight`` [H] the block's input norm (``zero_centered``: the Qwen3.5 form),
    ``moe`` a :class:`~redlite.layers.moe.SparseMoE` in x's dtype. Four launches (router
    product, routing, gate/up, down) with no host read. Returns ``x``. ``pdl``: programmatic dependent
    launch (see :mod:`redlite.layers.triton_gemv`); configs as ``GATE_UP_CONFIG`` /
    ``DOWN_CONFIG`` (the defaults), ``route_warps`` as ``ROUTE_WARPS``; ``configs``: the
    router product's GEMV table (:func:`redlite.layers.triton_gemv.gemv_config`).
    ``route_in_gate_up`` (default ``ROUTE_IN_GATE_UP``): every gate/up program routes for
    itself and the first one writes the routing for the down kernel (three launches).

    Early reads (``pdl`` 0 or 1 only: with 1 each kernel lets the next launch only after its
    own wait, so when a kernel starts, the kernel before the previous one has completed):
    ``down_early`` (default ``DOWN_EARLY``; not with ``route_in_gate_up``): the down kernel
    reads the routing (through L2) and the chosen experts' first weight tiles before it waits
    for the gate/up kernel; ``gate_up_early`` (default ``GATE_UP_EARLY``): each gate/up
    program normalises ``x`` (through L2) and computes its first block of the shared expert
    before it waits for the routing. Same results either way.
    """
    h = x.shape[-1]
    e, k, inter, s_inter = moe.num_experts, moe.top_k, moe.inter, moe.shared.inter
    logits = gemv(x, moe.gates_weight, None, norm_weight=norm_weight, eps=eps, out_float32=True, pdl=pdl,
                  zero_centered=zero_centered, configs=configs)
    i_max = max(inter, s_inter)
    block_tk = triton.next_power_of_2(k)
    route = torch.empty(2 * block_tk + 1, device=x.device, dtype=torch.float32)
    act = torch.empty(k + 1, i_max, device=x.device, dtype=x.dtype)
    extra = {"launch_pdl": True} if pdl else {}
    fused = ROUTE_IN_GATE_UP if route_in_gate_up is None else bool(route_in_gate_up)
    if not fused:
        _route_kernel[(1,)](logits, route, e, TOP_K=k, NORM_TOPK=bool(moe.norm_topk_prob),
                            BLOCK_E=triton.next_power_of_2(e), BLOCK_TK=block_tk, PDL=int(pdl),
                            num_warps=route_warps or ROUTE_WARPS, **extra)
    bn, bk, warps, per_sm = gate_up_config or GATE_UP_CONFIG
    nb_s, nb_r = triton.cdiv(s_inter, bn), triton.cdiv(inter, bn)
    n_blocks = nb_s + k * nb_r
    programs = min(n_blocks, per_sm * _sm_count(x.device)) if per_sm else n_blocks
    # striding programs are meant to be resident together: registers capped so per_sm fit
    regs = {"maxnreg": min(255, REGISTERS_PER_SM // (per_sm * warps * 32)) // 8 * 8} if per_sm else {}
    _gate_up_kernel[(programs,)](
        x, norm_weight, route, moe.gate_up_weight, moe.shared.gate_up_weight, act, h, inter, s_inter, i_max,
        float(eps), nb_s, nb_r, n_blocks, TOP_K=k, BLOCK_TK=block_tk, ZC=bool(zero_centered), BLOCK_N=bn,
        BLOCK_K=min(bk, triton.next_power_of_2(h)), STRIDED=bool(per_sm), PDL=int(pdl), logits_ptr=logits, E=e,
        ROUTE=fused, NORM_TOPK=bool(moe.norm_topk_prob), BLOCK_E=triton.next_power_of_2(e),
        EARLY=(GATE_UP_EARLY if gate_up_early is None else bool(gate_up_early)) and int(pdl) in (0, 1),
        num_warps=warps, **regs, **extra)
    early = (DOWN_EARLY if down_early is None else bool(down_early)) and not fused and int(pdl) in (0, 1)
    bn, bi, warps = down_config or DOWN_CONFIG
    _down_kernel[(triton.cdiv(h, bn),)](
        act, route, moe.down_weight, moe.shared.down_weight, x, h, inter, s_inter, i_max, TOP_K=k,
        BLOCK_TK=block_tk, BLOCK_N=bn, BLOCK_I=min(bi, triton.next_power_of_2(i_max)), PDL=int(pdl),
        EARLY=early, num_warps=warps, **extra)
    return x
