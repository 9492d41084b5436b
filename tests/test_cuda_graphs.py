"""The graph-capturable decode step (position as a tensor) and its CUDA-graph replay.

CPU: span buckets, the static step run eagerly against the normal forward, the engine's
static path through rewind/reset/restore, and (when Triton is installed) the Triton kernels
in Triton's interpreter. GPU (``-m gpu``): graph replay against eager decode in float32 and
bfloat16, rewind/reset/restore, sliding windows, chunked prefill, the kernels on the device.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from redlite.engine.cuda_graphs import GraphDecoder, bucket_spans, choose_span  # noqa: E402
from redlite.engine.kernel_options import KernelOptions  # noqa: E402
from redlite.engine.torch_engine import TorchEngine  # noqa: E402
from redlite.layers.decode_ops import TorchDecodeOps  # noqa: E402
from redlite.models.llama import LlamaModel  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=160, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0)
CONFIGS = {
    "llama": dict(BASE, model_type="llama", tie_word_embeddings=False),
    "qwen2_bias_tied": dict(BASE, model_type="qwen2", tie_word_embeddings=True),
    "qwen3_qk_norm": dict(BASE, model_type="qwen3", head_dim=32, tie_word_embeddings=False),
    "mistral_window": dict(BASE, model_type="mistral", sliding_window=8),
}


NO_CHUNKS = KernelOptions(chunk_graphs=False)  # short prefills token by token (not the chunk graphs)


def make_model(kind: str, device="cpu", dtype=torch.float32, seed=0, **overrides) -> LlamaModel:
    model = LlamaModel(dict(CONFIGS[kind], **overrides), device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.2
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def ids(n: int, seed: int = 1, vocab: int = 160) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_bucket_spans_and_choice():
    assert bucket_spans(5000) == [1024, 2048, 4096, 5000]
    assert bucket_spans(1024) == [1024]
    assert bucket_spans(100, first=16) == [16, 32, 64, 100]
    spans = bucket_spans(5000)
    assert choose_span(1, spans) == 1024 and choose_span(1024, spans) == 1024
    assert choose_span(1025, spans) == 2048 and choose_span(5000, spans) == 5000
    with pytest.raises(ValueError):
        choose_span(5001, spans)
    with pytest.raises(ValueError):
        choose_span(0, spans)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_static_step_matches_forward_on_cpu(kind):
    model = make_model(kind)
    ref = model.new_state(64, "cpu", torch.float32)
    static = model.new_state(64, "cpu", torch.float32)
    prompt = ids(12)
    decoder = GraphDecoder(model, static, use_graphs=False)
    assert decoder.spans == [64] and not decoder.use_graphs
    decoder.spans = [16, 32, 64]  # exercise the masked span buckets
    with torch.inference_mode():
        model(torch.tensor(prompt), ref)
        model(torch.tensor(prompt), static)
        token = 7
        for _ in range(24):  # crosses the window (8) and two span buckets
            want = model(torch.tensor([token]), ref)
            got = decoder.step(token, static.n_past)
            static.n_past += 1
            assert got.shape == want.shape and got.dtype == torch.float32
            assert (got - want).abs().max().item() < 1e-5
            token = int(want.argmax())
        n = ref.n_past
        assert torch.allclose(static.cache.data[:, :, :, :n], ref.cache.data[:, :, :, :n], atol=1e-5, rtol=1e-5)


def _engine_trace(engine: TorchEngine) -> list[torch.Tensor]:
    """Logits through prefill, decode, rewind, snapshot/restore and reset."""
    out = [engine.prefill(ids(10, seed=2))]
    for token in (3, 4, 5, 6):
        out.append(engine.decode(token))
    engine.rewind(11)
    out += [engine.decode(9), engine.decode(10)]
    snap = engine.snapshot()
    out.append(engine.decode(11))
    engine.restore(snap)
    out.append(engine.decode(11))
    engine.reset()
    out.append(engine.prefill(ids(5, seed=3)))
    out += [engine.decode(t) for t in (1, 2)]
    return out


def _check_engines(model, device, dtype, tol):
    eager = TorchEngine(model, ctx_size=48, device=device, dtype=dtype, cuda_graphs=False)
    static = TorchEngine(model, ctx_size=48, device=device, dtype=dtype, cuda_graphs=True)
    want, got = _engine_trace(eager), _engine_trace(static)
    assert eager.decode_path == "eager" and static.decode_path != "eager"
    for a, b in zip(want, got):
        assert (a - b).abs().max().item() < tol
    return static


def test_engine_static_path_survives_rewind_reset_restore_on_cpu():
    static = _check_engines(make_model("qwen3_qk_norm"), "cpu", torch.float32, 1e-5)
    assert static.decode_path == "static-eager/torch"


def test_short_prefill_through_the_decode_step_equals_eager_prefill():
    # graph_prefill_tokens: prefills that short run as decode steps (the static path on CPU)
    model = make_model("qwen3_qk_norm")
    eager = TorchEngine(model, ctx_size=48, device="cpu", cuda_graphs=False)
    stepped = TorchEngine(model, ctx_size=48, device="cpu", cuda_graphs=True, kernels=NO_CHUNKS)
    stepped.graph_prefill_tokens = 4
    for engine in (eager, stepped):
        engine.prefill(ids(10, seed=2))
    calls = []
    step = stepped._graph_step
    stepped._graph_step = lambda token: calls.append(token) or step(token)
    for n in (1, 4, 5):  # 5 > 4: one eager pass
        want, got = eager.prefill(ids(n, seed=n)), stepped.prefill(ids(n, seed=n))
        assert stepped.n_past == eager.n_past
        assert (want - got).abs().max().item() < 1e-5
    assert calls == ids(1, seed=1) + ids(4, seed=4)
    assert (eager.decode(7) - stepped.decode(7)).abs().max().item() < 1e-5
    assert TorchEngine(model, ctx_size=48, device="cpu").graph_prefill_tokens == 0  # default: never


def test_short_prefill_falls_back_to_eager_when_the_graph_step_fails():
    model = make_model("qwen3_qk_norm")
    eager = TorchEngine(model, ctx_size=48, device="cpu", cuda_graphs=False)
    stepped = TorchEngine(model, ctx_size=48, device="cpu", cuda_graphs=True, kernels=NO_CHUNKS)
    stepped.graph_prefill_tokens = 8
    step, fed = stepped._graph_step, []

    def fails_third(token):
        fed.append(token)
        return step(token) if len(fed) < 3 else None
    stepped._graph_step = fails_third
    want, got = eager.prefill(ids(6, seed=4)), stepped.prefill(ids(6, seed=4))
    assert stepped.n_past == eager.n_past == 6
    assert (want - got).abs().max().item() < 1e-5


TRITON_CHECK = Path(__file__).parent / "triton_kernel_check.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(TRITON_CHECK), "cpu"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


# --- GPU ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("kind", ["qwen3_qk_norm", "mistral_window", "qwen2_bias_tied"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_matches_eager_on_gpu(kind, dtype, tol):
    model = make_model(kind, device="cuda", dtype=dtype)
    static = _check_engines(model, "cuda", dtype, tol)
    assert static.decode_path.startswith("graph/")
    assert static._graph_decoder.n_graphs == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_with_torch_ops_buckets_on_gpu():
    model = make_model("llama", device="cuda", dtype=torch.float32)
    engine = TorchEngine(model, ctx_size=300, device="cuda", cuda_graphs=True)
    engine.prefill(ids(20))
    decoder = GraphDecoder(model, engine.state, ops=TorchDecodeOps())
    decoder.spans = [32, 64, 300]
    ref = TorchEngine(model, ctx_size=300, device="cuda", cuda_graphs=False)
    ref.prefill(ids(20))
    token = 1
    with torch.inference_mode():
        for _ in range(50):
            got = decoder.step(token, engine.state.n_past)[0].clone()
            engine.state.n_past += 1
            want = ref.decode(token)
            assert (got - want).abs().max().item() < 2e-4
            token = int(want.argmax())
    assert decoder.n_graphs == 3  # spans 32, 64 and 300


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
def test_chunked_prefill_on_gpu(dtype, tol):
    model = make_model("qwen3_qk_norm", device="cuda", dtype=dtype)
    whole = TorchEngine(model, ctx_size=256, device="cuda", dtype=dtype)
    chunked = TorchEngine(model, ctx_size=256, device="cuda", dtype=dtype, prefill_chunk=48)
    prompt = ids(200, seed=5)
    a, b = whole.prefill(prompt), chunked.prefill(prompt)
    assert (a - b).abs().max().item() < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_on_gpu():
    done = subprocess.run([sys.executable, str(TRITON_CHECK), "cuda"], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src")))
    assert done.returncode == 0, done.stdout + done.stderr
