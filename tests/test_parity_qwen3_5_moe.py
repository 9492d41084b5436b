"""Parity of redlite's Qwen3.5 mixture-of-experts model with transformers' ``Qwen3_5Moe*``.

Tiny random models (float32) are built with transformers' own classes and saved with
``save_pretrained`` (transformers 5.24 writes the per-expert layout of published checkpoints,
``mlp.experts.{e}.gate_proj.weight``); a second copy is rewritten in the fused layout
transformers holds in memory (``mlp.experts.gate_up_proj``), sharded, multimodal prefix.
Prefill, decode (the gathered-experts path), rollback and the static decode step are compared.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from hf_reference import import_without_cuda_kernels
from safetensors.torch import load_file, save_file


import_without_cuda_kernels("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

from redlite.engine.torch_engine import TorchEngine  # noqa: E402
from redlite.layers.moe import SparseMoE  # noqa: E402
from redlite.loading.hf import load_hf_model  # noqa: E402
from redlite.models import resolve_model_class  # noqa: E402
from redlite.models.qwen3_5 import Qwen3_5Model, export_recurrent, import_recurrent, load_qwen3_5  # noqa: E402

L, F = "linear_attention", "full_attention"
VOCAB = 97
PROMPT = 40
DECODE_STEPS = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, layer_types=[L, F, L, F],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, rms_norm_eps=1e-6, initializer_range=0.05)
    ref = Qwen3_5MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.005, 1.0, generator=gen).log())
            elif "norm" in name or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight"):  # spread router scores so top-k is well separated
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("moe")
    ref.save_pretrained(path)
    return ref.eval(), str(path)


@pytest.fixture(scope="module")
def model(built):
    return load_qwen3_5(built[1], "cpu", torch.float32)


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _cache_kwargs(ref, out) -> dict:
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = out.past_key_values
    key = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    return {key: cache}


def test_saved_checkpoint_uses_per_expert_names(built):
    from safetensors import safe_open

    with safe_open(f"{built[1]}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names


def test_matches_transformers_prefill_and_decode(built, model):
    ref = built[0]
    assert all(layer.moe for layer in model.layers)
    ids = _prompt(PROMPT)
    with torch.inference_mode():
        state = model.new_state(PROMPT + DECODE_STEPS + 1, "cpu", torch.float32)
        logits = model(ids, state, all_logits=True)
        out = ref(input_ids=ids[None], use_cache=True)
        assert (out.logits[0] - logits).abs().max().item() < ATOL
        assert logits.std().item() > 0.05  # not a flat model
        token = logits[-1].argmax()
        for _ in range(DECODE_STEPS):
            step = model(token.view(1), state)
            out = ref(input_ids=token.view(1, 1), use_cache=True, **_cache_kwargs(ref, out))
            assert (out.logits[0, -1] - step[0]).abs().max().item() < ATOL
            token = step[0].argmax()


def test_grouped_and_gathered_paths_agree(model):
    moe: SparseMoE = model.layers[0].mlp
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        weights, ids = moe.route(x)
        assert ids.shape == (9, 3) and torch.allclose(weights.sum(-1), torch.ones(9))
        grouped, gathered = moe._grouped(x, weights, ids), moe._gathered(x, weights, ids)
    assert (grouped - gathered).abs().max().item() < 1e-5


def test_fused_sharded_multimodal_layout_loads_identically(built, model, tmp_path):
    tensors = load_file(f"{built[1]}/model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        name = name.replace("model.", "model.language_model.", 1)
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            fused[name] = t
            continue
        e, proj = tail.split(".")[:2]
        fused.setdefault(f"{head}{sep}{proj}.{e}", t)
    out: dict[str, torch.Tensor] = {}
    for name, t in fused.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        proj, e = tail.split(".")
        if proj == "up_proj":
            continue
        base = f"{head}{sep}"
        if proj == "gate_proj":
            key = base + "gate_up_proj"
            piece = torch.cat([t, fused[f"{base}up_proj.{e}"]], dim=0)
        else:
            key, piece = base + "down_proj", t
        out.setdefault(key, [None] * 8)[int(e)] = piece
    out = {n: torch.stack(t) if isinstance(t, list) else t for n, t in out.items()}
    assert out["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 48, 64)
    names = sorted(out)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: out[n].contiguous() for n in part}, str(tmp_path / file))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads(open(f"{built[1]}/config.json").read())
    wrapped = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": config, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    loaded, _ = load_hf_model(tmp_path, "cpu", torch.float32)
    ours = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, ours[name]), name


def test_missing_expert_piece_is_reported(built):
    tensors = load_file(f"{built[1]}/model.safetensors")
    partial = {n: t for n, t in tensors.items() if not n.endswith("layers.2.mlp.experts.5.up_proj.weight")}
    fresh = Qwen3_5Model(json.loads(open(f"{built[1]}/config.json").read()), "cpu", torch.float32)
    with pytest.raises(KeyError, match="layers.2.mlp.experts.gate_up_proj"):
        fresh.load_hf_weights(partial)


def test_registry_names():
    for cfg in ({"architectures": ["Qwen3_5MoeForCausalLM"]}, {"model_type": "qwen3_5_moe_text"},
                {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}, {"model_type": "qwen3_5_moe"}):
        assert resolve_model_class(cfg) is Qwen3_5Model


def test_rollback_restores_exactly(model):
    p, x, y = _prompt(24, seed=4), _prompt(8, seed=5), _prompt(9, seed=6)
    with torch.inference_mode():
        state = model.new_state(128, "cpu", torch.float32)
        model(p, state)
        checkpoint = export_recurrent(state)
        model(x, state)
        model(x[0].view(1), state)
        import_recurrent(state, checkpoint, 24)
        resumed = [model(y, state, all_logits=True)] + [model(t.view(1), state) for t in y[:3]]
        cold = model.new_state(128, "cpu", torch.float32)
        model(p, cold)
        want = [model(y, cold, all_logits=True)] + [model(t.view(1), cold) for t in y[:3]]
    for a, b in zip(resumed, want):
        assert torch.equal(a, b)


def test_static_decode_step_matches_forward(model):
    """The engine's graph-capturable step (torch ops, eager on CPU) against the forward."""
    def trace(engine):
        out = [engine.prefill(_prompt(20, seed=2).tolist())]
        checkpoint = engine.take_checkpoint(out[-1])
        for t in (3, 4, 5):
            out.append(engine.decode(t))
        out.append(engine.restore_checkpoint(checkpoint))
        out += [engine.decode(t) for t in (6, 7)]
        return out

    eager = TorchEngine(model, ctx_size=64, device="cpu", dtype=torch.float32, cuda_graphs=False)
    static = TorchEngine(model, ctx_size=64, device="cpu", dtype=torch.float32, cuda_graphs=True)
    want, got = trace(eager), trace(static)
    assert static.decode_path != "eager"
    for a, b in zip(want, got):
        assert (a - b).abs().max().item() < 1e-4
