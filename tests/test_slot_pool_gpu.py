"""The slot pool on a CUDA device (``-m gpu``): eager batched decode and the batched CUDA
graphs (:class:`~redlite.engine.batch_graphs.BatchGraphs`) against each slot decoded alone, on
tiny random Llama and Qwen3.5 hybrid models in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.batch_graphs import BatchGraphs
from redlite.engine.torch_engine import TorchEngine
from test_hybrid_decode import make_model as make_hybrid
from test_slot_pool import assert_same, greedy_alone, make_llama, prompts, run_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_device_picks_feed_the_next_graph_step(kind):
    """Greedy picks left on the device and fed back as PICKED (slots joining late, the set
    shrinking: gathered picks mixed with host ids) give each prompt's tokens alone, float32."""
    model, vocab = (make_llama(), 96) if kind == "llama" else (make_hybrid(), 120)
    got, want = run_pool(model.to("cuda"), prompts(vocab, lengths=(5, 11, 1, 23, 7)), steps=12,
                         graphs=True, picks=True, device="cuda")
    assert_same(got, want, exact=False, tol=1e-3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_pool_batch_equals_alone_on_gpu(kind, graphs, dtype, tol):
    """Six slots decoded together for 12 steps (the batched graph is captured after 3) against
    each prompt decoded alone, both fed the alone run's greedy tokens (so bfloat16 rounding
    cannot make the histories diverge): logits within ``tol`` of their scale; float32
    greedy tokens equal."""
    model, vocab = (make_llama(), 96) if kind == "llama" else (make_hybrid(), 120)
    model = model.to("cuda", dtype)
    feeds, steps = prompts(vocab, lengths=(5, 11, 1, 23, 7, 3)), 12
    alone = TorchEngine(model, ctx_size=128, device="cuda", dtype=dtype, cuda_graphs=graphs)
    want, fed = greedy_alone(alone, feeds, steps)
    pool = TorchEngine(model, ctx_size=128, device="cuda", dtype=dtype, cuda_graphs=graphs)
    slots = [pool] + [pool.new_slot() for _ in feeds[1:]]
    for slot, ids in zip(slots, feeds):
        slot.prefill(ids)
    for step in range(steps):
        rows = pool.decode_batch(slots, [tokens[step] for tokens in fed])
        for i, row in enumerate(rows):
            expect = want[i][step + 1]
            err = float((row - expect).abs().max())
            assert err <= tol * max(1.0, float(expect.abs().max())), (i, step, err)
            if dtype == torch.float32:
                assert int(row.argmax()) == int(expect.argmax()), (i, step)
    built = pool._shared.get("batch_graphs")
    if graphs:
        assert isinstance(built, BatchGraphs) and built.use_graphs and built.captures == 1
    else:
        assert built is None


@pytest.mark.parametrize("gated,window", [(False, None), (False, 5), (True, None)])
def test_batched_attention_kernel_equals_one_sequence_kernel(gated, window):
    """:func:`batch_decode_attention` of 5 sequences at different positions against the
    single-sequence kernel on each, with the same key-slice count: outputs and written cache
    rows bitwise equal."""
    from redlite.layers import triton_batch_attention as tba
    from redlite.layers import triton_decode as td
    from redlite.layers.kv_cache import KVCache

    torch.manual_seed(0)
    h, kv, d, layers, splits, dev, dt = 8, 2, 64, 3, 4, torch.device("cuda"), torch.bfloat16
    positions = [0, 7, 40, 129, 3]
    width = (2 * h + 2 * kv) * d if gated else (h + 2 * kv) * d
    qkv = torch.randn(len(positions), width, device=dev, dtype=dt)
    cos, sin = torch.randn(256, 1, d, device=dev, dtype=dt), torch.randn(256, 1, d, device=dev, dtype=dt)
    norm = torch.randn(d if gated else h + kv, *(() if gated else (d,)), device=dev, dtype=dt)
    k_norm = torch.randn(d, device=dev, dtype=dt) if gated else None
    caches = [KVCache(layers, kv, d, 256, dev, dt) for _ in positions]
    for cache in caches:
        cache.data.normal_()
    twins = [KVCache(layers, kv, d, 256, dev, dt) for _ in positions]
    for twin, cache in zip(twins, caches):
        twin.data.copy_(cache.data)
    pos = torch.tensor(positions, device=dev)
    got = tba.batch_decode_attention(qkv, pos, cos, sin, norm, 1e-6, tba.cache_bases(caches, dev), caches[0], 1,
                                     h, kv, d, window, splits, gated=gated, k_norm_weight=k_norm)
    counters = torch.zeros(kv, dtype=torch.int32, device=dev)
    for b, twin in enumerate(twins):
        want = td.decode_attention(qkv[b:b + 1], pos[b:b + 1], cos, sin, norm, 1e-6, twin.keys[1], twin.values[1],
                                   h, kv, d, window, splits, counters, gated=gated, k_norm_weight=k_norm,
                                   combine_in_kernel=False)
        assert torch.equal(got[b], want), b
        assert torch.equal(caches[b].data, twin.data), b
