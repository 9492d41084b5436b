"""Batch invariance on a CUDA device (``-m gpu``): with ``KernelOptions(batch_invariant=True)``
a sequence decoded in a batched step gets bitwise the logits it gets decoded alone, in
bfloat16, whatever else is in the batch (:mod:`redlite.layers.triton_gemv_rows`), for the
Llama family and the Qwen3.5 hybrid (dense and MoE)."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.kernel_options import KernelOptions
from redlite.engine.torch_engine import TorchEngine
from test_hybrid_decode import make_model as make_hybrid
from test_moe_decode import make_model as make_moe
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


def make(kind: str):
    """A tiny random model of ``kind`` in bfloat16 on the GPU, and its vocabulary size."""
    if kind == "llama":
        model = make_llama(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=32)
    else:
        model = make_hybrid() if kind == "hybrid" else make_moe()
    return model.to("cuda", torch.bfloat16), model.vocab_size


@pytest.mark.parametrize("kind,invariant", [("llama", True), ("llama", False), ("hybrid", True), ("moe", True)])
def test_batched_graph_step_is_bitwise_the_lone_step(kind, invariant):
    """Five bfloat16 slots (different lengths, the set shrinking from 5 to 3) decoded through the
    batched graphs against each decoded alone on the same weights: bitwise equal logits with
    ``batch_invariant``; without it only close (cuBLAS picks its algorithm by batch size)."""
    model, vocab = make(kind)
    kernels = KernelOptions(batch_invariant=invariant)
    feeds, steps = prompts(vocab, lengths=(5, 11, 1, 23, 7)), 10
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
    assert pool._shared["batch_graphs"].ops.batch_invariant == invariant
    if not invariant:
        assert worst < 0.2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", ["hybrid", "moe"])
def test_hybrid_batched_step_rows_equal_lone_step(kind, dtype):
    """The Qwen3.5 batched step with the batch-invariant ops, eagerly, on batches of 4, 3, 2
    and 1 sequences at different positions: each row's logits, KV rows and conv/recurrent
    states bitwise those of the lone ``decode_step``
    (:func:`triton_batch_invariance_check.check_hybrid_rows`)."""
    from test_hybrid_decode import CONFIG as DENSE
    from test_moe_decode import CONFIG as MOE
    from triton_batch_invariance_check import check_hybrid_rows, hybrid_model  # imports Triton

    with torch.inference_mode():
        check_hybrid_rows(hybrid_model(DENSE if kind == "hybrid" else MOE, "cuda", dtype), "cuda", dtype)
