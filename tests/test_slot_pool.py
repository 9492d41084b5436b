"""The torch engine as a pool of slots: ``new_slot`` and ``decode_batch`` (one batched forward)
against each slot decoded alone, on tiny random models (Llama dense float32, Llama with Q8_0
weights through the fused C step, the Qwen3.5 hybrid) and the bundled model; slots stay
independent through rewind, snapshot/restore, token ranges and checkpoints of one of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from redlite.engine.base import PICKED, EngineError
from redlite.engine.batch_graphs import BatchGraphs
from redlite.engine.torch_engine import TorchEngine
from redlite.kernels import native
from redlite.layers.quant_weight import QuantTensor, QuantWeight
from redlite.models.llama import LlamaModel
from test_hybrid_decode import make_model as make_hybrid

LLAMA = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
needs_kernels = pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")


def make_llama(**extra) -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel({**LLAMA, **extra})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.eval()


def quantize_q8_0(model: LlamaModel) -> LlamaModel:
    """Every matrix of ``model`` replaced by Q8_0 blocks (gguf's quantizer), kept quantized."""
    import gguf

    def q8(weight: torch.Tensor) -> QuantWeight:
        data = gguf.quants.quantize(weight.detach().numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        return QuantWeight([QuantTensor("Q8_0", tuple(weight.shape), data.reshape(weight.shape[0], -1))])

    for layer in model.layers:
        for module, name in ((layer.attn, "qkv_weight"), (layer.attn, "o_weight"),
                             (layer.mlp, "gate_up_weight"), (layer.mlp, "down_weight")):
            weight = getattr(module, name)
            delattr(module, name)
            setattr(module, name, q8(weight))
    head = model.lm_head_weight
    delattr(model, "lm_head_weight")
    model.lm_head_weight = q8(head)
    model._fused_decode = None
    return model


def prompts(vocab: int, lengths=(5, 11, 1, 23)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy_alone(engine: TorchEngine, feeds: list[list[int]], steps: int) -> tuple[list, list[list[int]]]:
    """Each prompt decoded greedily alone on ``engine`` (reset between prompts): its logits
    (prefill's, then one per step) and the tokens fed after the prefill."""
    want, fed = [], []
    for ids in feeds:
        engine.reset()
        logits = [engine.prefill(ids)]
        for _ in range(steps):
            logits.append(engine.decode(int(logits[-1].argmax())))
        want.append(logits)
        fed.append([int(x.argmax()) for x in logits[:-1]])
    return want, fed


def run_pool(model, feeds: list[list[int]], steps: int, ctx: int = 96, graphs: bool = False,
             picks: bool = False, device: str = "cpu") -> tuple[list, list]:
    """Greedy decode of every prompt: (a) all slots of one pool through ``decode_batch`` with
    slots joining late (the last one starts ``steps // 2`` steps in); (b) each alone on its own
    engine. ``graphs``: engines with ``cuda_graphs`` (on CPU: the graph steps run eagerly, the
    batch through :class:`BatchGraphs`). ``picks``: after each batch the pool picks greedily
    (``greedy_batch_async``) and the next batch feeds ``PICKED`` for those slots (a late
    joiner's first token and a shrinking set mix picks with host ids). Returns the logits of
    both, per prompt, per step. ``device``: where the model is (float32)."""
    pool = TorchEngine(model, ctx_size=ctx, device=device, cuda_graphs=graphs)
    slots = [pool] + [pool.new_slot() for _ in feeds[1:]]
    alone = [TorchEngine(model, ctx_size=ctx, device=device, cuda_graphs=graphs) for _ in feeds]
    want = []
    for engine, ids in zip(alone, feeds):
        logits = [engine.prefill(ids)]
        for _ in range(steps):
            logits.append(engine.decode(int(logits[-1].argmax())))
        want.append(logits)
    got: list[list] = [[] for _ in feeds]
    late, picked = len(feeds) - 1, set()
    for i, (slot, ids) in enumerate(zip(slots, feeds)):
        if i != late:
            got[i].append(slot.prefill(ids))
    for step in range(steps + steps // 2):
        if step == steps // 2:
            got[late].append(slots[late].prefill(feeds[late]))
        active = [i for i in range(len(feeds)) if got[i] and len(got[i]) <= steps]
        tokens = [PICKED if i in picked else int(got[i][-1].argmax()) for i in active]
        rows = pool.decode_batch([slots[i] for i in active], tokens)
        for i, row in zip(active, rows):
            got[i].append(row)
        if picks:
            handle = pool.greedy_batch_async([slots[i] for i in active], rows)
            assert handle.ids() == [int(row.argmax()) for row in rows]
            picked = set(active)
    assert isinstance(pool._shared.get("batch_graphs"), BatchGraphs) == graphs
    return got, want


def assert_same(got, want, exact: bool, tol: float = 1e-4) -> None:
    for i, (g_steps, w_steps) in enumerate(zip(got, want)):
        assert len(g_steps) == len(w_steps)
        for step, (g, w) in enumerate(zip(g_steps, w_steps)):
            assert g.shape == w.shape and g.dtype == torch.float32
            if exact:
                assert torch.equal(g, w), (i, step, float((g - w).abs().max()))
            else:
                assert float((g - w).abs().max()) <= tol * max(1.0, float(w.abs().max())), (i, step)
                assert int(g.argmax()) == int(w.argmax()), (i, step)


@pytest.mark.parametrize("kind,graphs,picks", [
    ("llama", False, False), ("llama", True, False),  # the fused batch, the graph step; then fed PICKED
    ("hybrid", True, False), ("llama", True, True), ("llama", False, True), ("hybrid", True, True)])
def test_batch_equals_alone(kind, graphs, picks):
    model, vocab = (make_llama(), 96) if kind == "llama" else (make_hybrid(), 120)
    got, want = run_pool(model, prompts(vocab), steps=8, graphs=graphs, picks=picks)
    assert_same(got, want, exact=False)


def test_picked_without_a_pick_is_refused():
    pool = TorchEngine(make_llama(), ctx_size=32, device="cpu", cuda_graphs=True)
    other = pool.new_slot()
    pool.prefill([1, 2])
    other.prefill([3])
    with pytest.raises(EngineError, match="no pending pick"):
        pool.decode_batch([pool, other], [PICKED, 4])
    assert pool.n_past == 2 and other.n_past == 1


def test_llama_sliding_window_and_qk_norm_batch_equals_alone():
    model = make_llama(model_type="qwen3", sliding_window=8, use_sliding_window=True, max_window_layers=1)
    got, want = run_pool(model, prompts(96), steps=10)
    assert_same(got, want, exact=False)


@needs_kernels
def test_llama_quantized_fused_batch_is_bitwise_alone():
    model = quantize_q8_0(make_llama())
    assert model._fused() is not None
    got, want = run_pool(model, prompts(96), steps=10)
    assert_same(got, want, exact=True)


@needs_kernels
def test_llama_quantized_torch_path_rows_alone():
    """Quantized weights without the fused step (a window-free torch path): the products
    through the row kernel whatever the batch size, so bitwise equal too."""
    model = quantize_q8_0(make_llama())
    model._fused_decode = False  # the torch path, as on a model the fused step does not take
    got, want = run_pool(model, prompts(96, lengths=(3, 4, 5, 6, 7, 8)), steps=6)
    assert_same(got, want, exact=True)


def test_hybrid_batch_equals_alone():
    got, want = run_pool(make_hybrid(), prompts(120), steps=10)
    assert_same(got, want, exact=False)


def test_errors_leave_every_state_unchanged():
    model = make_llama()
    pool = TorchEngine(model, ctx_size=8, device="cpu")
    other = TorchEngine(model, ctx_size=8, device="cpu")
    slot = pool.new_slot()
    assert slot.n_past == 0 and slot.max_context == 8 and slot.model is model
    pool.prefill([1, 2, 3])
    slot.prefill([4] * 8)
    for slots, ids in (([pool, slot], [5, 6]), ([pool, pool], [5, 6]), ([pool, other], [5, 6]),
                       ([pool], [5, 6]), ([pool, slot], [5, 96])):
        with pytest.raises(EngineError):
            pool.decode_batch(slots, ids)
    assert (pool.n_past, slot.n_past, other.n_past) == (3, 8, 0)
    assert pool.decode_batch([], []) == []


def test_llama_slots_independent_through_rewind_snapshot_and_ranges():
    model = make_llama()
    pool = TorchEngine(model, ctx_size=64, device="cpu")
    a, b = pool, pool.new_slot()
    ref = TorchEngine(model, ctx_size=64, device="cpu")
    ids_a, ids_b = prompts(96, lengths=(9, 12))
    a.prefill(ids_a)
    b.prefill(ids_b)
    want_b = ref.prefill(ids_b)
    saved = a.snapshot()
    tail = a.snapshot_range(4)
    for step in range(4):  # a is rewound, restored and replaced while b decodes beside it
        a_logits, b_logits = pool.decode_batch([a, b], [step + 1, int(want_b.argmax())])
        want_b = ref.decode(int(want_b.argmax()))
        assert torch.allclose(b_logits, want_b, atol=1e-5)
        if step == 0:
            a.rewind(5)
        elif step == 1:
            a.restore(saved)
        elif step == 2:
            a.restore_range(tail)
    assert b.n_past == ref.n_past == 16 and a.n_past == 10
    assert torch.allclose(b.snapshot().tensors["kv"], ref.snapshot().tensors["kv"], atol=1e-5)


def test_hybrid_slots_independent_through_checkpoints():
    model = make_hybrid()
    pool = TorchEngine(model, ctx_size=64, device="cpu")
    a, b = pool, pool.new_slot()
    assert not a.can_rewind and not b.can_rewind
    ref_a, ref_b = (TorchEngine(model, ctx_size=64, device="cpu") for _ in range(2))
    ids_a, ids_b = prompts(120, lengths=(9, 12))
    la, lb = a.prefill(ids_a), b.prefill(ids_b)
    ra, rb = ref_a.prefill(ids_a), ref_b.prefill(ids_b)
    mark_a, mark_ref = a.take_checkpoint(la), ref_a.take_checkpoint(ra)
    for step in range(6):
        ta, tb = int(ra.argmax()), int(rb.argmax())
        la, lb = pool.decode_batch([a, b], [ta, tb])
        ra, rb = ref_a.decode(ta), ref_b.decode(tb)
        assert torch.allclose(la, ra, atol=1e-4) and torch.allclose(lb, rb, atol=1e-4)
        if step == 2:  # roll a back; b goes on untouched
            la, ra = a.restore_checkpoint(mark_a), ref_a.restore_checkpoint(mark_ref)
            assert torch.equal(la, ra) and a.n_past == 9
    held = b.snapshot()
    want = ref_b.snapshot()
    for name, tensor in want.tensors.items():
        assert torch.allclose(held.tensors[name], tensor, atol=1e-4), name


def test_batch_graphs_capture_only_steady_sets(monkeypatch):
    """A set of slots is captured once it decoded ``capture_after`` steps in a row; sets that
    keep changing run eagerly (the capture itself is a CUDA matter: recorded here)."""
    model = make_llama()
    pool = TorchEngine(model, ctx_size=64, device="cpu", cuda_graphs=True)
    a, b, c = pool, pool.new_slot(), pool.new_slot()
    for slot in (a, b, c):
        slot.prefill([1, 2, 3])
    graphs = BatchGraphs(model, a.state, use_graphs=True, capture_after=3)
    pool._shared["batch_graphs"] = graphs
    captured = []
    monkeypatch.setattr(graphs, "_capture", lambda key, states, span, io: captured.append(len(states)))
    for slots in ([a, b], [a, c], [a, b], [a, c], [b, c], [b, c]):
        pool.decode_batch(slots, [4] * len(slots))
    assert captured == []
    pool.decode_batch([b, c], [5, 5])
    assert captured == [2]
    assert (a.n_past, b.n_past, c.n_past) == (7, 8, 8)


@pytest.mark.timeout(60)
def test_batch_graphs_by_size_capture_at_once_with_the_address_table(monkeypatch):
    """With ops that read states by address, a graph is keyed by the batch size: its capture
    is asked at a size's first step whatever slots fill it, and its static input holds the
    tokens, the positions and each state's cache address (recorded here; CUDA runs it)."""
    model = make_llama()
    pool = TorchEngine(model, ctx_size=64, device="cpu", cuda_graphs=True)
    a, b, c = pool, pool.new_slot(), pool.new_slot()
    for n, slot in enumerate((a, b, c)):
        slot.prefill([1, 2, 3][:n + 1])
    graphs = BatchGraphs(model, a.state, use_graphs=True, capture_after=3)
    graphs.by_size = True
    pool._shared["batch_graphs"] = graphs
    captured = []
    monkeypatch.setattr(graphs, "_capture", lambda key, states, span, io: captured.append((key[0], io.tolist())))
    pool.decode_batch([c, a], [7, 8])
    pool.decode_batch([a, b, c], [4, 5, 6])
    addresses = [s.state.cache.data.data_ptr() for s in (a, b, c)]
    assert captured == [(2, [[7, 8], [3, 1], [addresses[2], addresses[0]]]),
                        (3, [[4, 5, 6], [2, 2, 4], addresses])]


def test_slot_warm_up_leaves_every_slot_empty_and_decoding_as_fresh():
    """warm_up_slots (run on CPU here): every batch size and a device-picks step run, each
    slot's graph decoder is built, every slot ends empty, and a pool decodes afterwards as a
    fresh one does."""
    from redlite.engine.warmup import warm_up_slots

    got = []
    for warm in (True, False):
        pool = TorchEngine(make_llama(), ctx_size=64, device="cpu", cuda_graphs=True)
        slots = [pool] + [pool.new_slot() for _ in range(3)]
        if warm:
            assert warm_up_slots(slots, devices=("cpu",)) > 0
            assert all(slot.n_past == 0 for slot in slots)
            assert all(slot._graph_decoder is not None for slot in slots[1:])
        for i, slot in enumerate(slots):
            slot.prefill([1 + i, 2, 3])
        rows = pool.decode_batch(slots, [4, 5, 6, 7])
        got.append(torch.stack(rows))
    assert torch.allclose(got[0], got[1], atol=1e-5)
