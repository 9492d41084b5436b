"""Short prefills through the chunk step (:mod:`redlite.models.chunk_step`,
:mod:`redlite.engine.chunk_graphs`): on CPU the same step runs eagerly (the torch ops), and
its logits, KV rows and later decode equal the eager forward pass's. GPU (``-m gpu``): the
captured graphs with the Triton chunk attention against eager prefill."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.chunk_graphs import BUCKETS, ChunkGraphs
from redlite.engine.torch_engine import TorchEngine
from test_cuda_graphs import CONFIGS, ids, make_model

pytestmark = pytest.mark.timeout(120)


def _spy(engine: TorchEngine) -> list[int]:
    """Lengths of the prefills that ran through ``engine``'s chunk graphs."""
    calls: list[int] = []
    chunks = engine.chunk_graphs()
    assert isinstance(chunks, ChunkGraphs)
    run = chunks.prefill
    chunks.prefill = lambda token_ids: calls.append(len(token_ids)) or run(token_ids)
    return calls


def _same(eager: TorchEngine, chunked: TorchEngine, want: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    assert chunked.n_past == eager.n_past
    assert (want - got).abs().max().item() < tol
    n = eager.n_past
    assert torch.allclose(chunked.state.cache.data[:, :, :, :n], eager.state.cache.data[:, :, :, :n],
                          atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_short_prefills_through_the_chunk_step_equal_eager_prefill(kind):
    model = make_model(kind)
    eager = TorchEngine(model, ctx_size=200, device="cpu", cuda_graphs=False)
    chunked = TorchEngine(model, ctx_size=200, device="cpu", cuda_graphs=True)
    calls = _spy(chunked)
    for engine in (eager, chunked):
        engine.prefill(ids(70, seed=2))  # longer than any chunk: the eager pass in both
    assert calls == []
    # padded (3 -> 4, 5 -> 8, 33 -> 64) and exact lengths; the window (8) inside one chunk
    for n in (2, 3, 5, 16, 33):
        want, got = eager.prefill(ids(n, seed=n)), chunked.prefill(ids(n, seed=n))
        _same(eager, chunked, want, got, 1e-5)
        token = int(want.argmax())
        _same(eager, chunked, eager.decode(token), chunked.decode(token), 1e-5)
    assert calls == [2, 3, 5, 16, 33]
    eager.rewind(75)
    chunked.rewind(75)
    _same(eager, chunked, eager.prefill(ids(9, seed=5)), chunked.prefill(ids(9, seed=5)), 1e-5)


def test_a_chunk_that_would_pad_past_the_cache_runs_eagerly():
    model = make_model("llama")
    eager = TorchEngine(model, ctx_size=41, device="cpu", cuda_graphs=False)
    chunked = TorchEngine(model, ctx_size=41, device="cpu", cuda_graphs=True)
    calls = _spy(chunked)
    for engine in (eager, chunked):
        engine.prefill(ids(20, seed=2))  # a 20-token chunk pads to 32
    assert calls == [20]
    # 17 tokens pad to 32: 20 + 32 > 41, so the eager pass serves; then 3 pad to 4: 37 + 4 fits
    _same(eager, chunked, eager.prefill(ids(17, seed=3)), chunked.prefill(ids(17, seed=3)), 1e-5)
    assert calls == [20] and chunked.n_past == 37
    _same(eager, chunked, eager.prefill(ids(3, seed=4)), chunked.prefill(ids(3, seed=4)), 1e-5)
    assert calls == [20, 3]
    assert max(BUCKETS) == 64


def test_chunk_graphs_are_off_without_graphs_or_when_switched_off():
    from redlite.engine.kernel_options import KernelOptions

    model = make_model("llama")
    assert TorchEngine(model, ctx_size=40, device="cpu", cuda_graphs=False).chunk_graphs() is None
    off = TorchEngine(model, ctx_size=40, device="cpu", cuda_graphs=True, kernels=KernelOptions(chunk_graphs=False))
    assert off.chunk_graphs() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("kind", ["qwen3_qk_norm", "mistral_window", "llama"])
def test_chunk_graphs_replay_equals_eager_prefill_on_gpu(kind, dtype, tol):
    replay_equals_eager_on_gpu(make_model(kind, device="cuda", dtype=dtype), dtype, tol, ids, (2, 7, 16, 40, 64),
                               len(BUCKETS))


def replay_equals_eager_on_gpu(model, dtype, tol, ids, lengths, n_graphs) -> None:
    """Graphs captured at start-up (``n_graphs`` of them), then prefills of ``lengths`` after
    200 held tokens replay them: logits and the next decode within ``tol`` (relative) of the
    eager engine's, and nothing captured while serving. ``ids(n, seed)``: the model's ids."""
    eager = TorchEngine(model, ctx_size=400, device="cuda", dtype=dtype, cuda_graphs=False)
    chunked = TorchEngine(model, ctx_size=400, device="cuda", dtype=dtype, cuda_graphs=True)
    chunked.prefill(ids(3, seed=1))
    assert chunked.capture_graphs() > 0 and chunked.chunk_graphs().n_graphs == n_graphs
    chunked.reset()
    calls = _spy(chunked)
    for engine in (eager, chunked):
        engine.prefill(ids(200, seed=2))
    for n in lengths:
        want, got = eager.prefill(ids(n, seed=n)), chunked.prefill(ids(n, seed=n))
        rel = ((want - got).norm() / want.norm()).item()
        assert chunked.n_past == eager.n_past and rel < tol, (n, rel)
        token = int(want.argmax())
        a, b = eager.decode(token), chunked.decode(token)
        assert ((a - b).norm() / a.norm()).item() < tol
    assert calls == list(lengths)
    assert chunked.chunk_graphs().n_graphs == n_graphs  # nothing captured while serving
