"""The graph-capturable decode step of the Qwen3.5 hybrid family and its CUDA-graph replay.

CPU: the static step (torch ops, run eagerly) against the normal forward through prefill,
decode, checkpoint restore and reset; the hybrid Triton kernels in Triton's interpreter (when
Triton is installed). GPU (``-m gpu``): graph replay against eager decode and against a
float32 reference on the CPU, the kernels on the device, and greedy decoding after a fork
restored from a device checkpoint equal to a cold run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hybrid_builders import assert_logits_close, fork_and_cold, random_ids, randomize, run_check_script
from redlite.engine.torch_engine import TorchEngine
from redlite.models.qwen3_5 import Qwen3_5Model

L, F = "linear_attention", "full_attention"
CONFIG = dict(model_type="qwen3_5_text", vocab_size=120, hidden_size=64, intermediate_size=96,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-6, layer_types=[L, F, L, L], num_hidden_layers=4,
              max_position_embeddings=512, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
HYBRID_CHECK = Path(__file__).resolve().parent / "triton_hybrid_check.py"


def make_model(device="cpu", dtype=torch.float32, seed=0) -> Qwen3_5Model:
    return randomize(Qwen3_5Model(CONFIG, device=device, dtype=dtype), seed)


def ids(n: int, seed: int = 1) -> list[int]:
    return random_ids(CONFIG["vocab_size"], n, seed)


def trace(engine: TorchEngine) -> list[torch.Tensor]:
    """Logits through prefill, decode, a checkpoint restore, more decode and a reset. Every
    engine is fed the same tokens (its own greedy picks could differ within rounding)."""
    out = [engine.prefill(ids(40, seed=2))]
    checkpoint = engine.take_checkpoint(out[-1])
    for token in ids(6, seed=4):
        out.append(engine.decode(token))
    out.append(engine.restore_checkpoint(checkpoint))
    out.append(engine.prefill(ids(7, seed=3)))
    for t in (5, 6, 7):
        out.append(engine.decode(t))
    engine.reset()
    out.append(engine.prefill(ids(5, seed=4)))
    out += [engine.decode(t) for t in (1, 2)]
    return out


def compare(model, device, dtype, tol):
    eager = TorchEngine(model, ctx_size=96, device=device, dtype=dtype, cuda_graphs=False)
    static = TorchEngine(model, ctx_size=96, device=device, dtype=dtype, cuda_graphs=True)
    want, got = trace(eager), trace(static)
    assert eager.decode_path == "eager" and static.decode_path != "eager"
    assert_logits_close(want, got, tol)
    return static


def test_static_step_matches_forward_on_cpu():
    static = compare(make_model(), "cpu", torch.float32, 1e-4)
    assert static.decode_path == "static-eager/torch"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_hybrid_triton_kernels_in_interpreter():
    done = run_check_script(HYBRID_CHECK, "cpu", interpret=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch.float32: hybrid ok" in done.stdout


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
def test_graph_replay_matches_eager_and_float32_on_gpu(dtype, tol):
    """Graph decode == eager decode on the device (same dtype), and both near the float32
    CPU reference."""
    model = make_model("cuda", dtype)
    static = compare(model, "cuda", dtype, tol)
    assert static.decode_path.startswith("graph/triton"), static.decode_path
    reference = TorchEngine(make_model(), ctx_size=96, device="cpu", dtype=torch.float32, cuda_graphs=False)
    want = trace(reference)
    static.reset()
    assert_logits_close(want, trace(static), max(tol, 1e-3))


@pytest.mark.gpu
@needs_cuda
def test_hybrid_triton_kernels_on_gpu():
    done = run_check_script(HYBRID_CHECK, "cuda", interpret=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch.bfloat16: hybrid ok" in done.stdout


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fork_from_gpu_checkpoint_decodes_like_cold(dtype):
    """Greedy tokens after restoring a device checkpoint (taken before another branch was
    decoded through the graph) equal a cold run fed the same segments."""
    model = make_model("cuda", dtype)
    engine = TorchEngine(model, ctx_size=160, device="cuda", dtype=dtype)
    warm, cold, checkpoint = fork_and_cold(engine, ids(50, seed=5), ids(9, seed=6), ids(11, seed=7))
    assert checkpoint.data["layers.0.recurrent"].device.type == "cuda"
    assert warm == cold


def test_checkpoint_restores_through_flat_and_per_tensor_copies():
    """A payload from export_recurrent restores with one copy per dtype; a plain dict of the
    same tensors (e.g. read back from disk, or on the host) restores per tensor; both exact."""
    model = make_model()
    state = model.new_state(64, "cpu", torch.float32)
    with torch.inference_mode():
        model(torch.tensor(ids(20)), state)
        saved = {name: t.clone() for name, t in state._recurrent_targets().items()}
        for payload in (state.export_recurrent(), dict(state.export_recurrent()),
                        {k: v.to(torch.float64) for k, v in state.export_recurrent().items()}):
            model(torch.tensor(ids(5, seed=9)), state)
            state.import_recurrent(payload, 20)
            assert state.n_past == 20
            for name, t in state._recurrent_targets().items():
                assert torch.equal(t, saved[name]), name


def test_payload_of_another_layout_is_refused_and_views_follow_the_flats():
    """import_recurrent skips the tensor-by-tensor check only for a payload of a state of the
    same layout: another model's payload (other shapes, other layers) is refused, the state
    unchanged. The per-layer views are views of the flat tensors, by one unbind for equal
    shapes or by slices for unequal ones, in layer order."""
    from redlite.engine.base import EngineError
    from redlite.models.qwen3_5_state import _views

    model = make_model()
    state = model.new_state(64, "cpu", torch.float32)
    with torch.inference_mode():
        model(torch.tensor(ids(20)), state)
    saved = {name: t.clone() for name, t in state._recurrent_targets().items()}
    narrow = randomize(Qwen3_5Model({**CONFIG, "linear_num_value_heads": 2}))
    moved = randomize(Qwen3_5Model({**CONFIG, "layer_types": [L, L, F, L]}))
    for other in (narrow, moved):
        payload = other.new_state(64, "cpu", torch.float32).export_recurrent()
        with pytest.raises(EngineError):
            state.import_recurrent(payload, 20)
        assert state.n_past == 20
        assert all(torch.equal(t, saved[name]) for name, t in state._recurrent_targets().items())
    same = make_model(seed=1).new_state(64, "cpu", torch.float32).export_recurrent()
    state.import_recurrent(same, 0)  # another model of this layout: its zero state
    assert all(not t.any() for t in state._recurrent_targets().values())

    flats = (torch.arange(12.0), torch.arange(8.0))
    conv, recurrent = _views(flats, {3: ((2, 2), (2, 2)), 5: ((4, 2), (2, 2))})
    assert [t.tolist() for t in conv.values()] == [[[0, 1], [2, 3]], [[4, 5], [6, 7], [8, 9], [10, 11]]]
    assert list(recurrent) == [3, 5] and recurrent[5].tolist() == [[4, 5], [6, 7]]
    recurrent[3].add_(100)
    conv[5].zero_()
    assert flats[1][:4].tolist() == [100, 101, 102, 103] and not flats[0][4:].any()
