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
from redlite.layers.decode_ops import TorchDecodeOps
from redlite.layers.rotary import RotaryTable

REF = TorchDecodeOps()


def close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype)
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
    if not err <= tol:  # NaN fails too
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e}")


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


def check_qk_rope(device, dtype, tol, gen):
    for heads, kv, dim, rotary, norm in ((8, 2, 64, 64, True), (4, 4, 128, 32, False), (32, 8, 128, 128, True)):
        table = RotaryTable(rotary, 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary)))
        cos, sin = table.get(0, 300, device, dtype)
        qkv = torch.randn(1, (heads + 2 * kv) * dim, generator=gen).to(device, dtype)
        nw = (1 + 0.3 * torch.randn(heads + kv, dim, generator=gen)).to(device, dtype) if norm else None
        for p in (0, 17, 299):
            pos = torch.tensor([p], device=device)
            cache = torch.randn(2, kv, 300, dim, generator=gen).to(device, dtype)
            caches = [cache.clone(), cache.clone()]
            got = tk.qk_rope_store(qkv, pos, cos, sin, nw, 1e-6, caches[0][0], caches[0][1], heads, kv, dim)
            want = REF.qk_rope_store(qkv, pos, cos, sin, nw, 1e-6, caches[1][0], caches[1][1], heads, kv, dim)
            close(f"q rope {heads}/{kv}/{dim}/{rotary} at {p}", got, want, tol)
            close(f"k/v store at {p}", caches[0][:, :, p], caches[1][:, :, p], tol)
            assert torch.equal(caches[0][:, :, :p], caches[1][:, :, :p]), "rows before pos changed"
            assert torch.equal(caches[0][:, :, p + 1:], caches[1][:, :, p + 1:]), "rows after pos changed"


def check_attention(device, dtype, tol, gen):
    for heads, kv, dim in ((8, 2, 64), (32, 8, 128), (4, 4, 64)):
        keys = torch.randn(kv, 300, dim, generator=gen).to(device, dtype)
        values = torch.randn(kv, 300, dim, generator=gen).to(device, dtype)
        q = torch.randn(heads, dim, generator=gen).to(device, dtype)
        for p in (0, 5, 63, 64, 200, 299):
            pos = torch.tensor([p], device=device)
            for window in (None, 16):
                want = REF.attention(q, keys, values, pos, 300, window)
                for splits in (1, 3, 7):
                    got = tk.decode_attention(q, keys, values, pos, window, splits)
                    close(f"attention {heads}/{kv}/{dim} pos {p} window {window} splits {splits}",
                          got, want, tol)


def check_silu_mul(device, dtype, tol, gen):
    gu = torch.randn(2, 600, generator=gen).to(device, dtype)
    close("silu_mul", tk.silu_mul(gu, 300), REF.silu_mul(gu.clone(), 300), tol)


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator().manual_seed(0)
    interpreted = device.type == "cpu"
    # the interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): looser there
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2 if interpreted else 1e-2)):
        with torch.inference_mode():
            check_norms(device, dtype, tol, gen)
            check_qk_rope(device, dtype, tol, gen)
            check_silu_mul(device, dtype, tol, gen)
            if not (interpreted and dtype != torch.float32):
                check_attention(device, dtype, tol, gen)
        print(f"{device} {dtype}: ok", flush=True)


if __name__ == "__main__":
    main()
