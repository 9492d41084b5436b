"""Checks the Triton decode kernels of the Qwen3.5 hybrid family against the torch reference
ops on random inputs: the zero-centred-norm forms of the matrix-vector kernel, the gated
attention (partial rotary, output gate) and the Gated DeltaNet step (conv, delta rule, gated
norm; the conv and recurrent states it writes too).

Usage: ``python tests/triton_hybrid_check.py cpu`` (with ``TRITON_INTERPRET=1``, as
``tests/triton_kernel_check.py``, whose interpreter patch it reuses) or ``... cuda``. Exits
non-zero with a message on the first mismatch. Run by ``tests/test_hybrid_decode.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_kernel_check import REF, check_decode_write, close  # noqa: E402  (applies the interpreter patch)

from redlite.layers import triton_decode as tk  # noqa: E402
from redlite.layers import triton_gdn  # noqa: E402
from redlite.layers import triton_gemv as tg  # noqa: E402
from redlite.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from redlite.layers.rotary import RotaryTable  # noqa: E402


def check_gemv_zero_centered(device, dtype, tol, gen):
    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    for n, k in ((37, 100), (64, 256)):
        x, nw, w, w2 = rand(1, k), rand(k, scale=0.3), rand(n, k, scale=0.1), rand(2 * n, k, scale=0.1)
        for config in ((4, 64, 4, 1, 0), (2, 128, 4, 1, 1)):
            c = f"{n}x{k} config {config}"
            close(f"gemv zero-centred norm {c}",
                  tg.gemv(x, w, None, norm_weight=nw, eps=1e-6, config=config, zero_centered=True),
                  REF.norm_linear(x, nw, 1e-6, w, None, zero_centered=True), tol)
            close(f"gemv zero-centred norm float32 {c}",
                  tg.gemv(x, w, None, norm_weight=nw, eps=1e-6, out_float32=True, config=config,
                          zero_centered=True),
                  REF.norm_linear(x, nw, 1e-6, w, None, out_float32=True, zero_centered=True), tol)
            close(f"gemv zero-centred gated {c}",
                  tg.gemv(x, w2, None, norm_weight=nw, eps=1e-6, gated=True, config=config, zero_centered=True),
                  REF.norm_gate_up(x, nw, 1e-6, w2, None, n, zero_centered=True), tol)


def check_gated_attention(device, dtype, tol, gen):
    """Gated attention: output, the cache row written, every other row kept."""
    for heads, kv, dim, rotary in ((4, 2, 64, 16), (8, 2, 32, 32)):
        table = RotaryTable(rotary, 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary)))
        cos, sin = table.get(0, 200, device, dtype)
        qn = (0.3 * torch.randn(dim, generator=gen)).to(device, dtype)
        kn = (0.3 * torch.randn(dim, generator=gen)).to(device, dtype)
        cache = torch.randn(2, kv, 200, dim, generator=gen).to(device, dtype)
        counters = torch.zeros(kv, dtype=torch.int32, device=device)
        for p in (0, 5, 64, 199):
            pos = torch.tensor([p], device=device)
            qkv = torch.randn(1, (2 * heads + 2 * kv) * dim, generator=gen).to(device, dtype)
            want_cache = cache.clone()
            want = REF.gated_rope_attend(qkv, pos, cos, sin, qn, kn, 1e-6, want_cache[0], want_cache[1], heads, kv,
                                         dim, 200)
            # 130: the combine takes the head in feature chunks; separate: a second launch combines
            for splits, separate in ((1, False), (3, False), (130, False), (130, True)):
                got_cache = cache.clone()
                got = tk.decode_attention(qkv, pos, cos, sin, qn, 1e-6, got_cache[0], got_cache[1], heads, kv, dim,
                                          None, splits, counters, gated=True, k_norm_weight=kn,
                                          combine_in_kernel=not separate).view(1, -1)
                name = f"gated attention {heads}/{kv}/{dim}/{rotary} pos {p} splits {splits} separate {separate}"
                check_decode_write(name, got, want, got_cache, want_cache, cache, p, counters, tol)


def check_gdn_step(device, dtype, tol, gen):
    """Three consecutive tokens through the fused step and through the torch reference, for
    whole value heads per program and for several column blocks per head (the last program of
    a key head then norms its heads), one and two value heads per key head, conv widths 2-4."""
    for hk, hv, dk, dv, block_v, width in ((2, 4, 16, 32, 32, 4), (2, 4, 16, 32, 16, 4), (2, 2, 32, 16, 16, 3),
                                           (2, 2, 32, 64, 16, 2)):
        mixer = GatedDeltaNet(64, hk, hv, dk, dv, conv_kernel_size=width, device=device, dtype=dtype)
        with torch.no_grad():
            for name, p in mixer.named_parameters():
                if name == "A_log":
                    p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
                else:
                    p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        conv = torch.randn(mixer.conv_state_shape(), generator=gen).to(device, dtype)
        rec = torch.randn(mixer.recurrent_state_shape(), generator=gen).to(device)
        got_conv, got_rec, want_conv, want_rec = conv.clone(), rec.clone(), conv.clone(), rec.clone()
        counters = torch.zeros(hk, dtype=torch.int32, device=device)
        for step in range(3):
            proj = torch.randn(1, mixer.in_proj_weight.shape[0], generator=gen).to(device, dtype)
            got = triton_gdn.gdn_step(proj, got_conv, got_rec, mixer, num_warps=4, block_v=block_v,
                                      counters=counters)
            want = REF.gdn_step(proj, want_conv, want_rec, mixer)
            name = f"gdn step {hk}/{hv}/{dk}/{dv} block_v {block_v} conv {width} token {step}"
            close(name, got, want, tol)
            close(name + " conv state", got_conv, want_conv, tol)
            close(name + " recurrent state", got_rec, want_rec, max(tol, 1e-5))
            assert not counters.any(), name + ": key-head counters not reset"


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator().manual_seed(0)
    interpreted = device.type == "cpu"
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2 if interpreted else 1e-2)):
        with torch.inference_mode():
            check_gemv_zero_centered(device, dtype, tol, gen)
            check_gdn_step(device, dtype, tol, gen)
            if not (interpreted and dtype != torch.float32):  # the interpreter's bf16 dot is broken
                check_gated_attention(device, dtype, tol, gen)
        print(f"{device} {dtype}: hybrid ok", flush=True)


if __name__ == "__main__":
    main()
