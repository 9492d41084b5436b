"""Short prefills of the Qwen3.5 hybrid through the chunk step
(:mod:`redlite.models.qwen3_5_chunk`, :class:`redlite.engine.chunk_graphs.ChunkGraphs`): on CPU
the step runs eagerly (torch ops, the torch delta rule) and its logits, KV rows, conv and
recurrent states and later decode equal the eager forward pass's, padded chunks included (the
padding stays out of the recurrent states). GPU (``-m gpu``): captured graphs against eager."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.torch_engine import TorchEngine
from redlite.layers.gated_deltanet import causal_conv1d
from test_chunk_prefill import _spy, replay_equals_eager_on_gpu
from test_hybrid_decode import CONFIG, ids, make_model

pytestmark = pytest.mark.timeout(120)


def _states(engine: TorchEngine) -> list[torch.Tensor]:
    n = engine.n_past
    cache = engine.state.cache
    return [*engine.state.export_recurrent().values(), *(k[:, :n] for k in cache.keys),
            *(v[:, :n] for v in cache.values)]


def _same(eager, chunked, want, got, tol):
    assert chunked.n_past == eager.n_past
    assert (want - got).abs().max().item() < tol
    for a, b in zip(_states(eager), _states(chunked)):
        assert torch.allclose(a, b, atol=tol, rtol=tol)


def test_padded_rows_leave_the_conv_state_as_the_real_rows_do():
    torch.manual_seed(0)
    weight, state = torch.randn(6, 4), torch.randn(6, 3)
    rows = torch.randn(5, 6)
    alone, padded = state.clone(), state.clone()
    want = causal_conv1d(rows[:3], alone, weight)
    got = causal_conv1d(rows, padded, weight, last=torch.tensor([2]))
    assert torch.allclose(got[:3], want) and torch.equal(padded, alone)


def test_short_hybrid_prefills_through_the_chunk_step_equal_eager_prefill():
    model = make_model()
    eager = TorchEngine(model, ctx_size=200, device="cpu", cuda_graphs=False)
    chunked = TorchEngine(model, ctx_size=200, device="cpu", cuda_graphs=True)
    calls = _spy(chunked)
    assert max(chunked.chunk_graphs().buckets) == 32
    for engine in (eager, chunked):
        engine.prefill(ids(40, seed=2))  # longer than any chunk: the eager pass in both
    assert calls == []
    for n in (2, 3, 5, 16, 21, 32):  # padded (3 -> 4, 5 -> 8, 21 -> 32) and exact lengths
        want, got = eager.prefill(ids(n, seed=n)), chunked.prefill(ids(n, seed=n))
        _same(eager, chunked, want, got, 1e-5)
        token = int(want.argmax())
        _same(eager, chunked, eager.decode(token), chunked.decode(token), 1e-5)
    assert calls == [2, 3, 5, 16, 21, 32]
    assert chunked.prefill(ids(33, seed=9)) is not None and calls[-1] == 32  # 33: eager


def test_the_mixture_of_experts_hybrid_has_no_chunk_step():
    from redlite.models.chunk_step import supports_chunk
    from redlite.models.qwen3_5 import Qwen3_5Model

    moe = Qwen3_5Model({**CONFIG, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "shared_expert_intermediate_size": 32})
    assert supports_chunk(make_model()) and not supports_chunk(moe)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
def test_hybrid_chunk_graphs_replay_equals_eager_prefill_on_gpu(dtype, tol):
    replay_equals_eager_on_gpu(make_model(device="cuda", dtype=dtype), dtype, tol, ids, (2, 7, 16, 21, 32), 4)
