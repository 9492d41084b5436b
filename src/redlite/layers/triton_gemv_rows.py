"""Batch-invariant products of a few decode rows (CUDA; importable only where Triton is).

:func:`gemv_rows` is :func:`redlite.layers.triton_gemv.gemv` for ``x`` [M, K], M tokens of M
sequences, with every output row computed by the same float operations, in the same order,
as the one-token kernel computes that row alone: each program loads a weight tile once and
applies it to its ``ROWS`` rows one after another, each row through the one-token kernel's
own tile helpers (norm prologue, per-tile ``tl.sum`` over the same tile shape and warps, the
same epilogue), keeping its float32 sums in its own row of a ``[ROWS, BLOCK_N]`` accumulator
(selecting a row with ``tl.where`` adds nothing to it). Launch settings are the one-token
kernel's for the shape (:func:`~redlite.layers.triton_gemv.gemv_config`), since the tile
shape and warp count decide the order of each row's sums. So a sequence decoded beside
others gets bitwise the logits it gets alone (``tests/test_batch_invariance_gpu.py``), which
cuBLAS does not promise (it picks algorithms by M).

The cost: the weights are read once per step, but the multiply-adds run on the CUDA cores,
``M`` per weight element, and the norm prologue once per row and tile; past a few rows a
step is bound by that arithmetic rather than by memory (``bench/batch_invariance.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from redlite.layers.triton_gemv import _load_tile, _sm_count, _x_tile, gemv_config

MAX_ROWS = 8  # rows per program at most (a second grid axis covers more)


@triton.jit
def _gemv_rows_kernel(w_ptr, x_ptr, nw_ptr, b_ptr, out_ptr, N, K, eps, n_blocks, M, x_stride, out_stride,
                      NORM: tl.constexpr, ZC: tl.constexpr, BIAS: tl.constexpr, MODE: tl.constexpr,
                      OUT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    row0 = tl.program_id(1) * ROWS
    ks = tl.arange(0, BLOCK_K)
    ridx = tl.arange(0, ROWS)
    dt = w_ptr.dtype.element_ty
    rstds = tl.full([ROWS], 1.0, tl.float32)
    if NORM:
        for m in tl.static_range(ROWS):
            xr = x_ptr + tl.minimum(row0 + m, M - 1).to(tl.int64) * x_stride
            sumsq = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = tl.load(xr + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
                sumsq += xs * xs
            rstds = tl.where(ridx == m, 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps), rstds)
    for block in range(pid, n_blocks, step):
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc_up = acc
        for k0 in range(0, K, BLOCK_K):
            w, w_up = _load_tile(w_ptr, block, N, K, k0, ks, BLOCK_N, MODE)
            wf = w.to(tl.float32)
            wf_up = w_up.to(tl.float32)
            for m in tl.static_range(ROWS):
                xr = x_ptr + tl.minimum(row0 + m, M - 1).to(tl.int64) * x_stride
                rstd = tl.sum(tl.where(ridx == m, rstds, 0.0), axis=0)
                x = _x_tile(xr, nw_ptr, k0, ks, K, rstd, NORM, ZC, dt)
                acc = tl.where((ridx == m)[:, None], acc + tl.sum(wf * x[None, :], axis=1)[None, :], acc)
                if MODE == 2:
                    acc_up = tl.where((ridx == m)[:, None], acc_up + tl.sum(wf_up * x[None, :], axis=1)[None, :],
                                      acc_up)
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        for m in tl.static_range(ROWS):
            row = row0 + m
            smask = rmask & (row < M)
            a = tl.sum(tl.where((ridx == m)[:, None], acc, 0.0), axis=0)
            if BIAS:
                a += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            y = a.to(dt).to(tl.float32)
            dst = out_ptr + row.to(tl.int64) * out_stride + rows
            if MODE == 1:
                res = tl.load(dst, mask=smask, other=0.0).to(tl.float32)
                tl.store(dst, (res + y).to(dt), mask=smask)
            elif MODE == 2:
                a_up = tl.sum(tl.where((ridx == m)[:, None], acc_up, 0.0), axis=0)
                if BIAS:
                    a_up += tl.load(b_ptr + N + rows, mask=rmask, other=0.0).to(tl.float32)
                up = a_up.to(dt).to(tl.float32)
                act = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)
                tl.store(dst, (act * up).to(dt), mask=smask)
            elif OUT_F32:
                tl.store(dst, y, mask=smask)
            else:
                tl.store(dst, y.to(dt), mask=smask)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: int, rows: int,
              out: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              out_float32: bool = False, zero_centered: bool = False, configs=None) -> torch.Tensor:
    """``x`` [M, K] (rows contiguous) through ``weight`` in ``mode`` (PLAIN, RESIDUAL or GATED
    of :mod:`~redlite.layers.triton_gemv`) into ``out`` [M, rows] (RESIDUAL: the residual,
    updated in place); arguments and rounding as :func:`~redlite.layers.triton_gemv.gemv`,
    which validates them and calls this for M > 1. Returns ``out``."""
    m, k = x.shape
    block_n, block_k, warps, stages, per_sm = gemv_config(mode, rows, k, configs)
    n_blocks = triton.cdiv(rows, block_n)
    programs = min(n_blocks, per_sm * _sm_count(x.device)) if per_sm else n_blocks
    rows_per_program = min(MAX_ROWS, triton.next_power_of_2(m))
    _gemv_rows_kernel[(programs, triton.cdiv(m, rows_per_program))](
        weight, x, x if norm_weight is None else norm_weight, x if bias is None else bias, out,
        rows, k, float(eps), n_blocks, m, x.stride(0), out.stride(0), NORM=norm_weight is not None,
        ZC=bool(zero_centered), BIAS=bias is not None, MODE=mode, OUT_F32=out_float32,
        BLOCK_N=block_n, BLOCK_K=block_k, ROWS=rows_per_program, num_warps=warps, num_stages=stages)
    return out
