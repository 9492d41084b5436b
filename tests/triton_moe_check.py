"""Checks the fused Triton mixture-of-experts decode step against the torch reference op
(:meth:`redlite.layers.decode_ops.TorchDecodeOps.moe`) on random inputs: the residual stream
it updates in place, for several expert counts, top-k, widths and launch configurations.

Usage: ``python tests/triton_moe_check.py cpu`` (with ``TRITON_INTERPRET=1``, as
``tests/triton_kernel_check.py``, whose interpreter patch it reuses) or ``... cuda``. Exits
non-zero with a message on the first mismatch. Run by ``tests/test_moe_decode.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_kernel_check import REF, close  # noqa: E402  (applies the interpreter patch)

from redlite.layers import triton_moe  # noqa: E402
from redlite.layers.moe import SparseMoE  # noqa: E402

# (hidden, experts, top_k, inter, shared inter, norm_topk_prob)
CASES = ((64, 8, 3, 24, 40, True), (128, 16, 4, 32, 32, False), (96, 6, 1, 48, 16, True),
         (37, 12, 8, 20, 24, True))  # odd hidden: row blocks past H; top-8 fills the id block


def make_moe(device, dtype, gen, hidden, experts, top_k, inter, shared, norm_topk):
    moe = SparseMoE(hidden, experts, top_k, inter, shared, norm_topk, device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            scale = 0.8 if name == "gates_weight" else 0.15  # spread router scores apart
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    return moe


def check_moe_step(device, dtype, tol, gen):
    for case in CASES:
        hidden = case[0]
        moe = make_moe(device, dtype, gen, *case)
        nw = (0.3 * torch.randn(hidden, generator=gen)).to(device, dtype)
        for step in range(3):
            x = torch.randn(1, hidden, generator=gen).to(device, dtype)
            want = REF.moe(x.clone(), nw, 1e-6, moe)
            # the second steps through the columns (block_k / block_i below the row lengths) and
            # its gate/up programs stride over the row blocks (one program per multiprocessor);
            # the third and fourth route inside the gate/up kernel (no routing kernel); the last
            # is the module's defaults
            for gate_up, down, route_warps in (((4, 4096, 4, 0), (4, 512, 4), 1), ((2, 32, 8, 1), (8, 16, 2), 4),
                                               ((4, 4096, 4, 0), (4, 512, 4), 0), ((2, 32, 8, 1), (8, 16, 2), 0),
                                               (None, None, None)):
                got = x.clone()
                out = triton_moe.moe_step(got, nw, 1e-6, moe, gate_up_config=gate_up, down_config=down,
                                          route_warps=route_warps or None,
                                          route_in_gate_up=None if route_warps is None else route_warps == 0)
                assert out.data_ptr() == got.data_ptr(), "moe_step must update x in place"
                close(f"moe step {case} token {step} configs {gate_up}/{down}", got, want, tol)


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator().manual_seed(0)
    interpreted = device.type == "cpu"
    # bfloat16: the interpreter truncates (every rounding step biased one way), the GPU rounds
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 6e-2 if interpreted else 2e-2)):
        with torch.inference_mode():
            check_moe_step(device, dtype, tol, gen)
        print(f"{device} {dtype}: moe ok", flush=True)


if __name__ == "__main__":
    main()
