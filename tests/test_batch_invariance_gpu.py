"""Batch invariance on a CUDA device (``-m gpu``): with ``KernelOptions(batch_invariant=True)``
a sequence decoded in a batched step gets bitwise the logits it gets decoded alone, in
bfloat16, whatever else is in the batch (:mod:`redlite.layers.triton_gemv_rows`)."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.kernel_options import KernelOptions
from redlite.engine.torch_engine import TorchEngine
from test_slot_pool import greedy_alone, make_llama, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]


@pytest.mark.parametrize("m", [2, 3, 5, 9])
@pytest.mark.parametrize("form", ["norm", "norm-zc-bias", "residual", "gated", "f32"])
def test_gemv_rows_equal_one_row_products(form, m):
    from redlite.layers import triton_gemv as tg

    gen = torch.Generator(device="cuda").manual_seed(m)
    n, k = (6144, 4096) if form != "norm-zc-bias" else (3000, 1000)
    weight = (torch.randn(2 * n if form == "gated" else n, k, generator=gen, device="cuda") * 0.02).bfloat16()
    x = (torch.randn(m, k, generator=gen, device="cuda") * 3).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).bfloat16()
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.02).bfloat16() if "bias" in form else None

    def run(rows):
        if form == "residual":
            return tg.gemv(rows, weight, bias, residual=torch.ones(rows.shape[0], n, device="cuda").bfloat16())
        return tg.gemv(rows, weight, bias, norm_weight=None if form == "residual" else nw, eps=1e-6,
                       gated=form == "gated", out_float32=form == "f32", zero_centered="zc" in form)
    together = run(x)
    alone = torch.cat([run(x[i:i + 1].contiguous()) for i in range(m)])
    assert torch.equal(together, alone), float((together.float() - alone.float()).abs().max())
    assert float((together.float() - alone.float()).abs().max()) == 0.0


@pytest.mark.parametrize("invariant", [True, False])
def test_batched_graph_step_is_bitwise_the_lone_step(invariant):
    """Five bfloat16 slots (different lengths, the set shrinking from 5 to 3) decoded through the
    batched graphs against each decoded alone on the same weights: bitwise equal logits with
    ``batch_invariant``; without it only close (cuBLAS picks its algorithm by batch size)."""
    model = make_llama(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=32).to("cuda", torch.bfloat16)
    kernels = KernelOptions(batch_invariant=invariant)
    feeds, steps = prompts(96, lengths=(5, 11, 1, 23, 7)), 10
    alone = TorchEngine(model, ctx_size=128, device="cuda", dtype=torch.bfloat16, kernels=kernels)
    want, fed = greedy_alone(alone, feeds, steps)
    pool = TorchEngine(model, ctx_size=128, device="cuda", dtype=torch.bfloat16, kernels=kernels)
    slots = [pool] + [pool.new_slot() for _ in feeds[1:]]
    for slot, ids in zip(slots, feeds):
        slot.prefill(ids)
    worst = 0.0
    for step in range(steps):
        live = slots if step < 6 else slots[:3]  # the set shrinks: another batch size
        rows = pool.decode_batch(live, [fed[i][step] for i in range(len(live))])
        for i, row in enumerate(rows):
            expect = want[i][step + 1]
            worst = max(worst, float((row - expect).abs().max()))
            if invariant:
                assert torch.equal(row, expect), (i, step, float((row - expect).abs().max()))
    assert pool._shared["batch_graphs"].captures >= 1
    if not invariant:
        assert worst < 0.2
