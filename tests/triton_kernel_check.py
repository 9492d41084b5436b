"""Checks the Triton decode kernels against the torch reference ops on random inputs.

Usage: ``python tests/triton_kernel_check.py cpu`` (with ``TRITON_INTERPRET=1``: Triton's
interpreter; its bfloat16 matrix products are broken, so attention is checked in float32
only there, and it truncates float32 -> bfloat16, so the bfloat16 tolerance is looser) or ``... cuda``. Exits non-zero with a message on the first mismatch. Run by
``tests/test_cuda_graphs.py``.
"""

from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with
    # int(array), which numpy >= 2.4 refuses for arrays of one dimension: take the element.
    from triton.runtime import interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor

from redlite.layers import triton_decode as tk
from redlite.layers import triton_gemv as tg
from redlite.layers.decode_ops import TorchDecodeOps
from redlite.layers.rotary import RotaryTable

REF = TorchDecodeOps()


def close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype)
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    if not err <= tol:  # NaN fails too
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e}")


def check_decode_write(name: str, got, want, got_cache, want_cache, cache, pos: int, counters, tol: float) -> None:
    """One decode-attention call against the reference: its output, the k/v row it wrote at
    ``pos`` (the row index is the third dim of the caches), every other row of ``cache``
    untouched and the split counters reset."""
    close(name, got, want, tol)
    close(name + " k/v row", got_cache[:, :, pos], want_cache[:, :, pos], tol)
    assert torch.equal(got_cache[:, :, :pos], cache[:, :, :pos]), name + ": rows before pos changed"
    assert torch.equal(got_cache[:, :, pos + 1:], cache[:, :, pos + 1:]), name + ": rows after changed"
    assert not counters.any(), name + ": slice counters not reset"


def check_norms(device, dtype, tol, gen):
    for rows, n in ((1, 4096), (3, 100)):
        x = torch.randn(rows, n, generator=gen).to(device, dtype)
        d = torch.randn(rows, n, generator=gen).to(device, dtype)
        w = (1 + 0.3 * torch.randn(n, generator=gen)).to(device, dtype)
        close("rms_norm", tk.add_rms_norm(x.clone(), None, w, 1e-6), REF.rms_norm(x, w, 1e-6), tol)
        xa, xb = x.clone(), x.clone()
        got, want = tk.add_rms_norm(xa, d, w, 1e-6), REF.add_rms_norm(xb, d, w, 1e-6)
        close("add_rms_norm", got, want, tol)
        close("add_rms_norm residual", xa, xb, tol)


def check_attention(device, dtype, tol, gen):
    """The fused attention kernel (q/k norm, rotary, KV write, split-KV attention, combine)
    against the reference ops: output, the cache row it writes, and every other row kept."""
    cases = ((8, 2, 64, 64, True), (32, 8, 128, 128, True), (4, 4, 64, 32, False), (4, 1, 64, 64, False))
    for heads, kv, dim, rotary, norm in cases:
        table = RotaryTable(rotary, 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary)))
        cos, sin = table.get(0, 300, device, dtype)
        nw = (1 + 0.3 * torch.randn(heads + kv, dim, generator=gen)).to(device, dtype) if norm else None
        cache = torch.randn(2, kv, 300, dim, generator=gen).to(device, dtype)
        counters = torch.zeros(kv, dtype=torch.int32, device=device)
        for p in (0, 5, 63, 64, 200, 299):
            pos = torch.tensor([p], device=device)
            qkv = torch.randn(1, (heads + 2 * kv) * dim, generator=gen).to(device, dtype)
            for window in (None, 16):
                want_cache = cache.clone()
                want = REF.rope_attend(qkv, pos, cos, sin, nw, 1e-6, want_cache[0], want_cache[1], heads, kv, dim,
                                       300, window)
                # 200: the combine takes the head in feature chunks; separate: a second launch combines
                for splits, separate in ((1, False), (3, False), (7, False), (200, False), (200, True)):
                    got_cache = cache.clone()
                    got = tk.decode_attention(qkv, pos, cos, sin, nw, 1e-6, got_cache[0], got_cache[1], heads,
                                              kv, dim, window, splits, counters, combine_in_kernel=not separate)
                    name = (f"attention {heads}/{kv}/{dim}/{rotary} pos {p} window {window} splits {splits}"
                            f"{' separate combine' if separate else ''}")
                    check_decode_write(name, got, want, got_cache, want_cache, cache, p, counters, tol)


def check_chunk_attention(device, dtype, tol, gen):
    """The chunk attention kernels (T tokens of one sequence at a device position) against
    the reference op: output, the T cache rows written, every other row kept."""
    from redlite.layers import triton_chunk_attention as tca

    for heads, kv, dim, rotary, norm in ((8, 2, 64, 64, True), (4, 4, 64, 32, False), (6, 2, 32, 32, False)):
        table = RotaryTable(rotary, 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary)))
        cos, sin = table.get(0, 300, device, dtype)
        nw = (1 + 0.3 * torch.randn(heads + kv, dim, generator=gen)).to(device, dtype) if norm else None
        cache = torch.randn(2, kv, 300, dim, generator=gen).to(device, dtype)
        for n, p in ((1, 0), (5, 0), (16, 7), (37, 250), (8, 292)):
            pos = torch.tensor([p], device=device)
            qkv = torch.randn(n, (heads + 2 * kv) * dim, generator=gen).to(device, dtype)
            for window in (None, 16):
                want_cache = cache.clone()
                want = REF.chunk_rope_attend(qkv, pos, cos, sin, nw, 1e-6, want_cache[0], want_cache[1], heads, kv,
                                             dim, 300, window)
                for splits, block_r in ((1, 64), (3, 16), (9, 64)):
                    got_cache = cache.clone()
                    got = tca.chunk_attention(qkv, pos, cos, sin, nw, 1e-6, got_cache[0], got_cache[1], heads, kv,
                                              dim, window, splits, config={"block_r": block_r})
                    name = f"chunk attention {heads}/{kv}/{dim}/{rotary} {n} at {p} window {window} splits {splits}"
                    close(name, got, want, tol)
                    close(name + " k/v rows", got_cache[:, :, p:p + n], want_cache[:, :, p:p + n], tol)
                    assert torch.equal(got_cache[:, :, :p], cache[:, :, :p]), name + ": rows before changed"
                    assert torch.equal(got_cache[:, :, p + n:], cache[:, :, p + n:]), name + ": rows after changed"


def check_silu_mul(device, dtype, tol, gen):
    gu = torch.randn(2, 600, generator=gen).to(device, dtype)
    close("silu_mul", tk.silu_mul(gu, 300), REF.silu_mul(gu.clone(), 300), tol)


GEMV_CASE_CONFIGS = ((4, 64, 4, 1, 0), (8, 512, 4, 3, 0), (1, 32, 2, 2, 1), (2, 128, 4, 1, 1))


def check_gemv(device, dtype, tol, gen, configs=GEMV_CASE_CONFIGS):
    """Every form of the fused matrix-vector kernel against the reference ops, with tiles that
    do and do not divide the shape, one column tile and several, one program per row block
    and programs striding over several (``programs_per_sm`` 1); ``configs``: the launch
    settings tried."""
    def rand(*shape, base=0.0, scale=1.0):
        return (base + scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    for n, k in ((37, 100), (64, 256), (5, 300)):
        x, nw = rand(1, k), rand(k, base=1.0, scale=0.3)
        w, w2, bias, bias2 = rand(n, k, scale=0.1), rand(2 * n, k, scale=0.1), rand(n), rand(2 * n)
        for config in configs:
            c = f"{n}x{k} config {config}"
            for b in (None, bias):
                close(f"gemv {c} bias {b is not None}", tg.gemv(x, w, b, config=config),
                      REF.linear(x, w, b), tol)
                close(f"gemv norm {c}", tg.gemv(x, w, b, norm_weight=nw, eps=1e-6, config=config),
                      REF.norm_linear(x, nw, 1e-6, w, b), tol)
            close(f"gemv norm float32 {c}",
                  tg.gemv(x, w, None, norm_weight=nw, eps=1e-6, out_float32=True, config=config),
                  REF.norm_linear(x, nw, 1e-6, w, None, out_float32=True), tol)
            res = rand(1, n)
            got_res, want_res = res.clone(), res.clone()
            got = tg.gemv(x, w, bias, residual=got_res, config=config)
            REF.linear_residual(x, w, bias, want_res)
            assert got is got_res, "residual form returns the residual"
            close(f"gemv residual {c}", got_res, want_res, tol)
            for b in (None, bias2):
                close(f"gemv gated {c} bias {b is not None}",
                      tg.gemv(x, w2, b, norm_weight=nw, eps=1e-6, gated=True, config=config),
                      REF.norm_gate_up(x, nw, 1e-6, w2, b, n), tol)


def check_gemv_table(device, dtype, tol):
    """:func:`check_gemv` with the table's setting that its cases lack (8 rows a block on 8
    warps, the 35B-A3B shapes'), on inputs of its own (the other checks keep theirs)."""
    check_gemv(device, dtype, tol, torch.Generator().manual_seed(1), configs=((8, 2048, 8, 1, 2),))


def check_pdl(device, dtype, gen):
    """Launched with programmatic dependent launch (every mode), the kernels give the same
    results as launched plainly (CUDA compute capability 9.0+ only)."""
    x, w = torch.randn(1, 256, generator=gen).to(device, dtype), torch.randn(96, 256, generator=gen).to(device, dtype)
    nw = torch.ones(256, device=device, dtype=dtype)
    table = RotaryTable(64, 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    cos, sin = table.get(0, 100, device, dtype)
    qkv = torch.randn(1, 16 * 64, generator=gen).to(device, dtype)
    counters = torch.zeros(4, dtype=torch.int32, device=device)
    pos = torch.tensor([70], device=device)
    cache = torch.randn(2, 4, 100, 64, generator=gen).to(device, dtype)
    plain = tg.gemv(x, w, norm_weight=nw, eps=1e-6)
    attn = tk.decode_attention(qkv, pos, cos, sin, None, 1e-6, cache[0].clone(), cache[1].clone(), 8, 4, 64,
                               None, 5, counters)
    for mode in (1, 2):
        assert torch.equal(tg.gemv(x, w, norm_weight=nw, eps=1e-6, pdl=mode), plain), f"gemv pdl {mode}"
        got = tk.decode_attention(qkv, pos, cos, sin, None, 1e-6, cache[0].clone(), cache[1].clone(), 8, 4, 64,
                                  None, 5, counters, pdl=mode)
        assert torch.equal(got, attn), f"attention pdl {mode}"


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator().manual_seed(0)
    interpreted = device.type == "cpu"
    # the interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): looser there
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2 if interpreted else 1e-2)):
        with torch.inference_mode():
            check_norms(device, dtype, tol, gen)
            check_silu_mul(device, dtype, tol, gen)
            check_gemv(device, dtype, tol, gen)
            check_gemv_table(device, dtype, tol)
            if not (interpreted and dtype != torch.float32):
                check_attention(device, dtype, tol, gen)
                check_chunk_attention(device, dtype, tol, gen)
            if device.type == "cuda" and tg.pdl_supported(device):
                check_pdl(device, dtype, gen)
        print(f"{device} {dtype}: ok", flush=True)


if __name__ == "__main__":
    main()
