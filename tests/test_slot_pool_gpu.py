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


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_one_graph_per_batch_size_serves_every_set_of_slots(kind):
    """Five slots decoded in sets that change every step (pairs and triples in turn, each slot
    fed its alone run's greedy tokens), float32: every row equals that prompt decoded alone
    (greedy tokens equal, logits within 1e-3), and the pool captured one graph per batch size
    (two), whatever slots filled it."""
    model, vocab = (make_llama(), 96) if kind == "llama" else (make_hybrid(), 120)
    model = model.to("cuda")
    feeds, steps = prompts(vocab, lengths=(5, 11, 1, 23, 7)), 8
    want, fed = greedy_alone(TorchEngine(model, ctx_size=128, device="cuda", cuda_graphs=True), feeds, steps)
    pool = TorchEngine(model, ctx_size=128, device="cuda", cuda_graphs=True)
    slots = [pool] + [pool.new_slot() for _ in feeds[1:]]
    for slot, ids in zip(slots, feeds):
        slot.prefill(ids)
    done = [0] * len(slots)
    sets = [(0, 1), (2, 3, 4), (1, 3), (4, 0, 2), (3, 0), (1, 2, 4), (2, 4), (0, 1, 3)]
    for step in range(24):
        chosen = [i for i in sets[step % len(sets)] if done[i] < steps]
        if len(chosen) < 2:
            continue
        rows = pool.decode_batch([slots[i] for i in chosen], [fed[i][done[i]] for i in chosen])
        for i, row in zip(chosen, rows):
            done[i] += 1
            expect = want[i][done[i]]
            assert float((row - expect).abs().max()) <= 1e-3 * max(1.0, float(expect.abs().max())), (i, step)
            assert int(row.argmax()) == int(expect.argmax()), (i, step)
    built = pool._shared["batch_graphs"]
    assert built.by_size and built.captures == 2 and built.n_graphs == 2


@pytest.mark.parametrize("block_v", [16, 32])
def test_batched_gdn_kernel_equals_one_sequence_kernel(block_v):
    """:func:`gdn_step_batch` of 4 sequences whose states sit in separate flat buffers, found
    by address, against :func:`gdn_step` on copies of each: outputs and updated conv and
    recurrent states bitwise equal, counters left zero (bfloat16, two value heads per key
    head, so the last program of a key head writes the q/k conv window; 16-byte aligned
    buffers and rows, as the states of real shapes)."""
    from redlite.layers import triton_gdn
    from redlite.layers.gated_deltanet import GatedDeltaNet

    torch.manual_seed(0)
    dev, dt, batch = torch.device("cuda"), torch.bfloat16, 4
    mixer = GatedDeltaNet(64, 2, 4, 16, 32, conv_kernel_size=4, device=dev, dtype=dt)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(-2.0, 1.0) if name == "A_log" else 0.5 * torch.randn_like(p))
    conv_n, rec_n = torch.Size(mixer.conv_state_shape()), torch.Size(mixer.recurrent_state_shape())
    pad = 64  # the layer's states start past the flat buffers' starts, as in a multi-layer state
    flats = [(torch.randn(pad + conv_n.numel(), device=dev).to(dt), torch.randn(pad + rec_n.numel(), device=dev))
             for _ in range(batch)]
    views = [(c[pad:].view(conv_n), r[pad:].view(rec_n)) for c, r in flats]
    twins = [(c.clone(), r.clone()) for c, r in views]
    proj = torch.randn(batch, mixer.in_proj_weight.shape[0], device=dev).to(dt)
    conv_bases = torch.tensor([c.data_ptr() for c, _ in flats], device=dev)
    rec_bases = torch.tensor([r.data_ptr() for _, r in flats], device=dev)
    counters = torch.zeros(batch * 2, dtype=torch.int32, device=dev)
    with torch.inference_mode():
        got = triton_gdn.gdn_step_batch(proj, conv_bases, rec_bases, pad, pad, views[0][0], mixer,
                                        counters=counters, block_v=block_v)
        for b, (conv, rec) in enumerate(twins):
            want = triton_gdn.gdn_step(proj[b:b + 1], conv, rec, mixer, block_v=block_v)
            assert torch.equal(got[b:b + 1], want), b
            assert torch.equal(views[b][0], conv) and torch.equal(views[b][1], rec), b
    assert not counters.any()
