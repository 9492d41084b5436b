"""Checks the fused Triton mixture-of-experts decode step against the torch reference op
(:meth:`redlite.layers.decode_ops.TorchDecodeOps.moe`) on random inputs: the residual stream
it updates in place, for several expert counts, top-k, widths and launch configurations, with
and without the early reads; on CUDA also the early reads under programmatic dependent launch
in a captured graph (:func:`check_pdl_graph`).

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
            # its gate/up programs stride over the row blocks (one program per multiprocessor,
            # fewer than the shared expert's blocks); the third and fourth route inside the
            # gate/up kernel (the fourth computing no shared block early); the fifth and sixth
            # read nothing early; the last is the module's defaults
            small, strided = dict(gate_up_config=(4, 4096, 4, 0), down_config=(4, 512, 4)), \
                dict(gate_up_config=(2, 32, 8, 1), down_config=(8, 16, 2))
            for options in (dict(small, route_warps=1, route_in_gate_up=False),
                            dict(strided, route_warps=4, route_in_gate_up=False),
                            dict(small, route_in_gate_up=True),
                            dict(strided, route_in_gate_up=True, gate_up_early=False),
                            dict(small, route_in_gate_up=False, down_early=False, gate_up_early=False),
                            dict(strided, route_in_gate_up=False, down_early=False, gate_up_early=False),
                            dict()):
                got = x.clone()
                out = triton_moe.moe_step(got, nw, 1e-6, moe, **options)
                assert out.data_ptr() == got.data_ptr(), "moe_step must update x in place"
                close(f"moe step {case} token {step} options {options}", got, want, tol)


def check_pdl_graph(device, layers: int = 4, replays: int = 3):
    """CUDA with programmatic dependent launch: the Qwen3.5-35B-A3B block shape (hidden 2048,
    256 experts, top 8, widths 512) over ``layers`` distinct layers as one captured graph with
    ``pdl`` 1 and the early reads, bitwise equal to plain launches without them, replay after
    replay (an early read of data not yet written would show as a difference)."""
    from redlite.layers.triton_gemv import pdl_supported

    if not pdl_supported(device):
        print(f"{device}: no programmatic dependent launch, pdl graph check skipped", flush=True)
        return
    dtype, dgen = torch.bfloat16, torch.Generator(device=device).manual_seed(1)
    blocks = [SparseMoE(2048, 256, 8, 512, 512, True, device=device, dtype=dtype) for _ in range(layers)]
    for moe in blocks:
        for name, p in moe.named_parameters():
            p.normal_(0.0, 0.05 if name == "gates_weight" else 0.02, generator=dgen)
    norms = [0.3 * torch.randn(2048, generator=dgen, device=device, dtype=dtype) for _ in range(layers)]
    x0 = torch.randn(1, 2048, generator=dgen, device=device, dtype=dtype)
    for down in ((2, 256, 2), (1, 512, 2), (2, 512, 4)):
        want = x0.clone()
        for moe, nw in zip(blocks, norms):
            triton_moe.moe_step(want, nw, 1e-6, moe, down_config=down, down_early=False, gate_up_early=False)
        x = x0.clone()

        def steps():
            for moe, nw in zip(blocks, norms):
                triton_moe.moe_step(x, nw, 1e-6, moe, pdl=1, down_config=down, down_early=True, gate_up_early=True)

        steps()
        torch.cuda.synchronize(device)
        assert torch.equal(x, want), f"pdl eager (down {down}) differs from plain launches"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            steps()
        for replay in range(replays):
            x.copy_(x0)
            graph.replay()
            torch.cuda.synchronize(device)
            assert torch.equal(x, want), f"pdl graph (down {down}) replay {replay} differs from plain launches"
    print(f"{device}: moe pdl graph ok", flush=True)


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator().manual_seed(0)
    interpreted = device.type == "cpu"
    # bfloat16: the interpreter truncates (every rounding step biased one way), the GPU rounds
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 6e-2 if interpreted else 2e-2)):
        with torch.inference_mode():
            check_moe_step(device, dtype, tol, gen)
        print(f"{device} {dtype}: moe ok", flush=True)
    if device.type == "cuda":
        with torch.inference_mode():
            check_pdl_graph(device)


if __name__ == "__main__":
    main()
