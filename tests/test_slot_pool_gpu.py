"""The slot pool on a CUDA device (``-m gpu``): eager batched decode and the batched CUDA
graphs (:class:`~redlite.engine.batch_graphs.BatchGraphs`) against each slot decoded alone, on
tiny random Llama and Qwen3.5 hybrid models in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.batch_graphs import BatchGraphs
from redlite.engine.torch_engine import TorchEngine
from test_hybrid_decode import make_model as make_hybrid
from test_slot_pool import make_llama, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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
    want, fed = [], []
    for ids in feeds:
        alone.reset()
        logits = [alone.prefill(ids)]
        for _ in range(steps):
            logits.append(alone.decode(int(logits[-1].argmax())))
        want.append(logits)
        fed.append([int(x.argmax()) for x in logits[:-1]])
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
