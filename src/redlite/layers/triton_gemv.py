"""Triton matrix-vector products of the one-token decode step, with the work around them fused
in (CUDA; importable only where Triton is).

One kernel ``y = W @ f(x)`` for a weight ``W`` [N, K] (row-major, the ``nn.Linear`` layout)
and one token ``x`` [1, K], in four forms that together cover a llama decoder layer in four
matrix kernels instead of four matrix kernels plus three element-wise ones:

* ``norm``: ``x`` is RMS-normalised (statistics in float32, the scale ``norm_weight`` applied
  in the model dtype, as :func:`redlite.layers.norm.rms_norm` rounds) inside every program,
  so the norm needs no kernel of its own (q/k/v and the lm_head; ``out_float32`` gives the
  logits as float32 after rounding to the model dtype, as ``linear(...).float()`` does).
* ``residual``: ``residual += W @ x`` in place, rounded as ``residual.add_(linear(x))`` (the
  attention output and MLP down projections).
* ``gated``: the fused gate/up weight [2N, K] (gate rows first): ``silu(gate) * up`` is
  computed in the epilogue (with ``norm`` for the post-attention norm), as
  :meth:`redlite.layers.decode_ops.TorchDecodeOps.silu_mul` rounds.

Each program reads ``block_n`` rows in ``block_k`` column tiles and keeps float32 sums;
with ``programs_per_sm`` set, a fixed number of programs stride over the row blocks. With
``pdl`` (programmatic dependent launch, Hopper and newer) the kernel is launched so that it
may start while the previous kernel finishes: it loads its first weight tile (weights never
change) before ``griddepcontrol.wait`` and reads or writes activations only after it, so the
launch gap and the previous kernel's tail are spent streaming weights; it also calls
``griddepcontrol.launch_dependents`` (see :func:`pdl_sync`) so the next kernel can do the
same in its turn. Launch settings per shape come from :func:`gemv_config` (measured with
``bench/gpu_tune.py``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

try:  # griddepcontrol (programmatic dependent launch); a no-op where PDL is off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL unavailable
    gdc_launch_dependents = gdc_wait = None

PLAIN, RESIDUAL, GATED = 0, 1, 2


@triton.jit
def pdl_sync(PDL: tl.constexpr):
    """Where a kernel launched with programmatic dependent launch starts touching activations:
    ``PDL`` 1 waits for the previous kernel, then lets the next one launch; 2 lets the next
    one launch first, then waits; 0 (a plain launch) does nothing."""
    if PDL == 1:
        gdc_wait()
        gdc_launch_dependents()
    elif PDL == 2:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _x_tile(x_ptr, nw_ptr, k0, ks, K, rstd, NORM: tl.constexpr, ZC: tl.constexpr, dt: tl.constexpr,
            CG: tl.constexpr = False):
    """Columns ``k0 + ks`` of the (normalised) input row as float32, rounded like torch
    (``ZC``: the zero-centred Qwen3.5 norm, scaled by ``1 + w`` in float32 before rounding;
    ``CG``: the row read through L2, for a read before the PDL wait)."""
    cols = k0 + ks
    kmask = cols < K
    if CG:
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(nw_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
        if ZC:
            x = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
        else:
            x = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x


@triton.jit
def _load_tile(w_ptr, block, N, K, k0, ks, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """Weight columns ``k0 + ks`` of row block ``block`` (and of its up rows when GATED);
    rows past ``N`` read nothing."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < N)[:, None] & (k0 + ks < K)[None, :]
    offsets = rows.to(tl.int64)[:, None] * K + k0 + ks[None, :]
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0)
    w_up = w
    if MODE == 2:  # the up rows follow the N gate rows
        up = (rows.to(tl.int64) + N)[:, None] * K + k0 + ks[None, :]
        w_up = tl.load(w_ptr + up, mask=mask, other=0.0)
    return w, w_up


@triton.jit
def _row_block(w, w_up, x0, block, w_ptr, x_ptr, nw_ptr, b_ptr, out_ptr, N, K, rstd, ks,
               NORM: tl.constexpr, ZC: tl.constexpr, BIAS: tl.constexpr, MODE: tl.constexpr, OUT_F32: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dt: tl.constexpr, CG: tl.constexpr = False):
    """Finish row block ``block`` from its first tile ``w``/``w_up`` and first input tile
    ``x0``: the remaining column tiles, then the epilogue of the form MODE (``CG``: input
    tiles read through L2, see :func:`_x_tile`)."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.sum(w.to(tl.float32) * x0[None, :], axis=1)
    acc_up = acc
    if MODE == 2:
        acc_up = tl.sum(w_up.to(tl.float32) * x0[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = _x_tile(x_ptr, nw_ptr, k0, ks, K, rstd, NORM, ZC, dt, CG)
        w, w_up = _load_tile(w_ptr, block, N, K, k0, ks, BLOCK_N, MODE)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if MODE == 2:
            acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    if BIAS:
        acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if MODE == 2:
            acc_up += tl.load(b_ptr + N + rows, mask=rmask, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32)
    if MODE == 1:
        res = tl.load(out_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, (res + y).to(dt), mask=rmask)
    elif MODE == 2:
        up = acc_up.to(dt).to(tl.float32)
        act = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)
        tl.store(out_ptr + rows, (act * up).to(dt), mask=rmask)
    elif OUT_F32:
        tl.store(out_ptr + rows, y, mask=rmask)
    else:
        tl.store(out_ptr + rows, y.to(dt), mask=rmask)


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, nw_ptr, b_ptr, out_ptr, N, K, eps, n_blocks,
                 NORM: tl.constexpr, ZC: tl.constexpr, BIAS: tl.constexpr, MODE: tl.constexpr, OUT_F32: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # programs stride over the row blocks; each loads the next block's first tile before it
    # works on the current one, and the very first before waiting for the previous kernel
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    ks = tl.arange(0, BLOCK_K)
    dt = w_ptr.dtype.element_ty
    w, w_up = _load_tile(w_ptr, pid, N, K, 0, ks, BLOCK_N, MODE)
    pdl_sync(PDL)
    rstd = 1.0
    if NORM:
        sumsq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_ptr + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
            sumsq += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps)
    x0 = _x_tile(x_ptr, nw_ptr, 0, ks, K, rstd, NORM, ZC, dt)
    for block in range(pid, n_blocks, step):
        w_next, w_up_next = _load_tile(w_ptr, block + step, N, K, 0, ks, BLOCK_N, MODE)
        _row_block(w, w_up, x0, block, w_ptr, x_ptr, nw_ptr, b_ptr, out_ptr, N, K, rstd, ks,
                   NORM, ZC, BIAS, MODE, OUT_F32, BLOCK_N, BLOCK_K, dt)
        w, w_up = w_next, w_up_next


# (block_n, block_k, num_warps, num_stages, programs_per_sm) by (mode, rows, k): the best of
# bench/gpu_tune.py --gemv on an H200 for Qwen3-8B's shapes (2026-11-29; its output is in
# bench/results/). programs_per_sm 0: one program per row block. Other shapes take
# DEFAULT_CONFIG. --gemv-configs names a JSON file of {"mode,rows,k": [the five]} (as --save
# writes) used instead (read_gemv_configs).
Config = tuple[int, int, int, int, int]
GEMV_CONFIGS: dict[tuple[int, int, int], Config] = {
    (PLAIN, 6144, 4096): (4, 4096, 8, 1, 2), (RESIDUAL, 4096, 4096): (4, 4096, 8, 1, 2),
    (GATED, 12288, 4096): (2, 4096, 8, 1, 2), (RESIDUAL, 4096, 12288): (8, 1024, 4, 1, 4),
    (PLAIN, 151936, 4096): (4, 4096, 8, 1, 4),
    # Qwen3.5-9B shapes, not swept: the settings of the nearest Qwen3-8B shape
    (PLAIN, 12352, 4096): (4, 4096, 8, 1, 2), (PLAIN, 10240, 4096): (4, 4096, 8, 1, 2),
    (PLAIN, 248320, 4096): (4, 4096, 8, 1, 4),
    # Qwen3.5-35B-A3B (hidden 2048): the Gated DeltaNet in_proj, the attention qkv and the
    # lm_head; the best of bench/hybrid_profile.py --search-gemv (the whole decode step's
    # time per setting) on an H200; its other shapes keep DEFAULT_CONFIG
    (PLAIN, 12352, 2048): (8, 2048, 8, 1, 2), (PLAIN, 9216, 2048): (8, 2048, 8, 1, 2),
    (PLAIN, 248320, 2048): (8, 2048, 8, 1, 2)}
DEFAULT_CONFIG: Config = (4, 4096, 8, 1, 2)


@functools.lru_cache(maxsize=None)
def read_gemv_configs(path: str) -> dict[tuple[int, int, int], Config]:
    """The launch settings table of a JSON file ``{"mode,rows,k": [the five]}`` (what
    ``bench/gpu_tune.py --gemv --save`` writes). Raises ``OSError`` or ``ValueError``."""
    data = json.loads(Path(path).read_text())
    return {tuple(int(v) for v in key.split(",")): tuple(int(v) for v in value) for key, value in data.items()}


def gemv_config(mode: int, n: int, k: int,
                configs: dict[tuple[int, int, int], Config] | None = None) -> Config:
    """Launch settings ``(block_n, block_k, num_warps, num_stages, programs_per_sm)`` for ``mode`` (PLAIN,
    RESIDUAL or GATED) and a weight of ``n`` output rows (per half when gated) by ``k``; the
    column tile is capped at the next power of two of ``k``. ``configs``: the table to look
    in (:func:`read_gemv_configs`; None: ``GEMV_CONFIGS``)."""
    table = GEMV_CONFIGS if configs is None else configs
    block_n, block_k, warps, stages, per_sm = table.get((mode, n, k), DEFAULT_CONFIG)
    return block_n, min(block_k, triton.next_power_of_2(k)), warps, stages, per_sm


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def pdl_supported(device: torch.device) -> bool:
    """True where programmatic dependent launch exists: CUDA compute capability >= 9.0 and a
    Triton with ``griddepcontrol``."""
    device = torch.device(device)
    return (gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         gated: bool = False, out_float32: bool = False, pdl: int = 0,
         config: Config | None = None, zero_centered: bool = False,
         configs: dict[tuple[int, int, int], Config] | None = None) -> torch.Tensor:
    """One token through a weight: ``x`` [1, K] (contiguous), ``weight`` [N, K] or, ``gated``,
    [2N, K]; ``bias`` [N] (or [2N]) or None; all one dtype. Returns:

    * ``residual`` given ([1, N]): ``residual`` itself after ``residual += W @ x`` in place;
    * ``gated``: ``silu(gate) * up`` [1, N];
    * otherwise ``W @ x`` [1, N] in x's dtype, or float32 (rounded to x's dtype first) when
      ``out_float32``.

    ``x`` [M, K] (M > 1, rows contiguous; ``residual`` [M, N]): M tokens, each row bitwise as
    alone (:func:`redlite.layers.triton_gemv_rows.gemv_rows`; ``pdl`` and ``config`` unused).

    ``norm_weight`` [K]: RMSNorm ``x`` with it and ``eps`` first (``zero_centered``: the
    Qwen3.5 form ``x * rstd * (1 + w)``, as :func:`redlite.layers.norm.zero_centered_rms_norm`
    rounds). ``pdl`` (only where
    :func:`pdl_supported`): 0 launches plainly; 1 with programmatic dependent launch, letting
    the next kernel launch once this one's programs have waited for the previous kernel; 2
    letting it launch at once. ``config``: launch settings, default :func:`gemv_config` of
    ``configs``.
    Raises ``ValueError`` on mismatched shapes.
    """
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    rows = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.numel() != m * k or m < 1 or weight.shape[1] != k or (gated and weight.shape[0] % 2) \
            or (m > 1 and (x.dim() != 2 or x.stride(1) != 1)):
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    mode = RESIDUAL if residual is not None else (GATED if gated else PLAIN)
    if residual is not None:
        if residual.numel() != m * rows or not residual.is_contiguous():
            raise ValueError(f"gemv: residual {tuple(residual.shape)} for {m} x {rows} rows")
        out = residual
    else:
        out = torch.empty(m, rows, device=x.device, dtype=torch.float32 if out_float32 else x.dtype)
    if m > 1:
        from redlite.layers.triton_gemv_rows import gemv_rows

        return gemv_rows(x, weight, bias, mode, rows, out.view(m, rows), norm_weight=norm_weight, eps=eps,
                         out_float32=out_float32, zero_centered=zero_centered, configs=configs)
    block_n, block_k, warps, stages, per_sm = config or gemv_config(mode, rows, k, configs)
    n_blocks = triton.cdiv(rows, block_n)
    programs = min(n_blocks, per_sm * _sm_count(x.device)) if per_sm else n_blocks
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(programs,)](
        weight, x, x if norm_weight is None else norm_weight, x if bias is None else bias, out,
        rows, k, float(eps), n_blocks, NORM=norm_weight is not None, ZC=bool(zero_centered),
        BIAS=bias is not None, MODE=mode,
        OUT_F32=out_float32, BLOCK_N=block_n, BLOCK_K=block_k, PDL=int(pdl),
        num_warps=warps, num_stages=stages, **extra)
    return out
