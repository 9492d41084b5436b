"""The torch engine against Hugging Face transformers on tiny random Llama-family models,
plus rewind, snapshot/restore, sampling and context-overflow behaviour."""

from __future__ import annotations

import pytest

import torch
import transformers

from redlite.engine.base import EngineError, SamplingParams  # noqa: E402
from redlite.engine.sampling import TorchSampler, filter_logits  # noqa: E402
from redlite.engine.torch_engine import TorchEngine  # noqa: E402
from redlite.layers.rotary import inv_frequencies, rope_parameters  # noqa: E402

TOL = 1e-4
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=160, max_position_embeddings=256,
              initializer_range=0.2, rms_norm_eps=1e-6)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE,
                                               tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    "mistral_window": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),
}


def _build(kind: str, directory):
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    path = directory / kind
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf_model, path = _build(request.param, tmp_path_factory.mktemp("models"))
    engine = TorchEngine.from_pretrained(path, device="cpu", dtype=torch.float32)
    return hf_model, engine


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf_model, path = _build("llama3", tmp_path_factory.mktemp("llama"))
    return hf_model, path


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_prefill_and_greedy_decode_match_transformers(pair):
    hf_model, engine = pair
    engine.reset()
    ids = _prompt(20)
    logits = [engine.prefill(ids)]
    for _ in range(8):
        ids.append(int(torch.argmax(logits[-1])))
        logits.append(engine.decode(ids[-1]))
    assert engine.n_past == 28
    ref = _hf_logits(hf_model, ids)[19:]
    ours = torch.stack(logits)
    assert ours.dtype == torch.float32 and ours.shape == (9, COMMON["vocab_size"])
    assert (ours - ref).abs().max().item() < TOL


def test_all_position_logits_match(pair):
    hf_model, engine = pair
    engine.reset()
    ids = _prompt(24, seed=3)
    with torch.inference_mode():
        ours = engine.model(torch.tensor(ids), engine.state, all_logits=True)
    assert (ours - _hf_logits(hf_model, ids)).abs().max().item() < TOL


def test_chunked_prefill_after_held_tokens(pair):
    hf_model, engine = pair
    ids = _prompt(30, seed=4)
    engine.reset()
    engine.prefill(ids[:5])
    engine.prefill_chunk = 7
    try:
        last = engine.prefill(ids[5:])
    finally:
        engine.prefill_chunk = 2048
    assert (last - _hf_logits(hf_model, ids)[-1]).abs().max().item() < TOL


def test_rewind_then_prefill_equals_cold_prefill(llama):
    _, path = llama
    engine = TorchEngine.from_pretrained(path, ctx_size=64)
    a, b = _prompt(20, seed=5), _prompt(6, seed=6)
    engine.prefill(a)
    engine.rewind(12)
    assert engine.n_past == 12 and engine.state_nbytes() > 0
    warm = engine.prefill(b)
    warm_next = engine.decode(3)
    engine.reset()
    cold = engine.prefill(a[:12] + b)
    cold_next = engine.decode(3)
    assert (warm - cold).abs().max().item() < 1e-5
    assert (warm_next - cold_next).abs().max().item() < 1e-5
    with pytest.raises(EngineError):
        engine.rewind(engine.n_past + 1)


def test_snapshot_restore(llama):
    _, path = llama
    engine = TorchEngine.from_pretrained(path, ctx_size=64)
    engine.prefill(_prompt(10, seed=7))
    snap = engine.snapshot()
    assert snap.n_past == 10 and snap.tensor_format == "torch"
    assert snap.nbytes == engine.state_nbytes()
    assert all(t.device.type == "cpu" for t in snap.tensors.values())
    expected = engine.decode(5)
    engine.decode(6)
    engine.restore(snap)
    assert engine.n_past == 10
    assert torch.equal(engine.decode(5), expected)
    other = TorchEngine.from_pretrained(path, ctx_size=32)
    other.restore(snap)
    assert torch.equal(other.decode(5), expected)
    assert other.fingerprint() == engine.fingerprint()
    snap.meta["fingerprint"] = "another model"
    with pytest.raises(EngineError):
        other.restore(snap)


def test_context_overflow_raises(llama):
    _, path = llama
    engine = TorchEngine.from_pretrained(path, ctx_size=16)
    assert engine.max_context == 16
    engine.prefill(_prompt(10))
    with pytest.raises(EngineError):
        engine.prefill(_prompt(7))
    assert engine.n_past == 10
    for token in range(6):
        engine.decode(token)
    with pytest.raises(EngineError):
        engine.decode(1)
    assert engine.n_past == 16


def test_default_context_is_capped(llama):
    _, path = llama
    engine = TorchEngine.from_pretrained(path)
    assert engine.max_context == COMMON["max_position_embeddings"]
    assert engine.can_rewind and engine.vocab_size == COMMON["vocab_size"]


def test_sharded_checkpoint_loads(llama, tmp_path):
    hf_model, path = llama
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = _prompt(12, seed=11)
    sharded = TorchEngine.from_pretrained(tmp_path).prefill(ids)
    assert torch.equal(sharded, TorchEngine.from_pretrained(path).prefill(ids))
    assert not sharded.is_inference()  # callers may edit logits in place


def test_seeded_sampling_is_deterministic():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)

    def draws(p):
        sampler = TorchSampler(p)
        return [sampler.sample(logits) for _ in range(20)]

    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=43))
    assert TorchSampler(SamplingParams(temperature=0.0)).sample(logits) == int(logits.argmax())


def test_top_k_top_p_min_p():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(**kw))).nonzero().flatten().tolist()  # noqa: E731
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.5) == [0]
    assert kept(top_p=0.6) == [0, 1]
    assert kept(top_p=0.8) == [0, 1, 2]
    assert kept(min_p=0.3) == [0, 1, 2]
    assert kept(top_k=3, min_p=0.35) == [0, 1]
    sampler = TorchSampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {sampler.sample(logits) for _ in range(200)} == {0, 1}
    sampler = TorchSampler(SamplingParams(temperature=1.0, min_p=0.25, seed=0))
    assert {sampler.sample(logits) for _ in range(200)} == {0, 1, 2}
    # temperature sharpens: 0.05 makes the top token nearly certain
    sampler = TorchSampler(SamplingParams(temperature=0.05, seed=0))
    assert {sampler.sample(logits) for _ in range(50)} == {0}


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    LLAMA3_ROPE,
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**COMMON, rope_parameters=dict(rope))
    ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours, scale = inv_frequencies(16, rope_parameters(config.to_dict()), COMMON["max_position_embeddings"])
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0) and abs(scale - ref_scale) < 1e-7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.15)])
def test_cuda_matches_transformers(llama, dtype, tol):
    hf_cpu, path = llama
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    engine = TorchEngine.from_pretrained(path, device="cuda", dtype=dtype)
    ids = _prompt(20, seed=8)
    logits = [engine.prefill(ids)]
    for _ in range(8):
        ids.append(int(torch.argmax(logits[-1])))
        logits.append(engine.decode(ids[-1]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0, 19:].float()
    ours = torch.stack(logits)
    assert ours.device.type == "cuda" and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < tol
    snap = engine.snapshot()
    assert all(t.device.type == "cpu" for t in snap.tensors.values())
    expected = engine.decode(7)
    engine.restore(snap)
    assert torch.equal(engine.decode(7), expected)
    sampler = engine.make_sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=1))
    assert 0 <= sampler.sample(expected) < COMMON["vocab_size"]


def test_engine_checkpoints_on_a_recurrent_model():
    """TorchEngine over a model whose state cannot truncate (Qwen3.5 hybrid): rollback goes
    through take_checkpoint/restore_checkpoint and their host form."""
    from redlite.models import qwen3_5

    config = transformers.Qwen3_5TextConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
    model = qwen3_5.Qwen3_5Model(config.to_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    engine = TorchEngine(model.eval(), ctx_size=64)
    assert not engine.can_rewind
    ids, more = [i % 97 for i in _prompt(10, seed=9)], [i % 97 for i in _prompt(5, seed=10)]
    logits = engine.prefill(ids)
    checkpoint = engine.take_checkpoint(logits, turn_boundary=True)
    assert checkpoint.position == 10 and checkpoint.nbytes > 0
    after = engine.prefill(more)
    with pytest.raises(EngineError):
        engine.rewind(10)
    assert torch.equal(engine.restore_checkpoint(checkpoint), logits)
    assert engine.n_past == 10
    assert (engine.prefill(more) - after).abs().max().item() < 1e-5
    tensors, meta = engine.checkpoint_to_tensors(checkpoint)
    rebuilt = engine.checkpoint_from_tensors(10, tensors, meta, turn_boundary=True)
    assert torch.equal(engine.restore_checkpoint(rebuilt), logits) and engine.n_past == 10
    assert (engine.prefill(more) - after).abs().max().item() < 1e-5
    snap = engine.snapshot()
    expected = engine.decode(4)
    engine.reset()
    assert engine.n_past == 0
    engine.restore(snap)
    assert engine.n_past == 15 and torch.equal(engine.decode(4), expected)
