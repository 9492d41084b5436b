"""Parity of redlite's Qwen3.5 hybrid model with transformers' reference, plus state rollback.

Tiny random-weight models are built with transformers (float32), saved with
``save_pretrained`` and loaded by :func:`redlite.models.qwen3_5.load_qwen3_5`. Without
flash-linear-attention installed, transformers runs its own PyTorch fallback of the gated
delta rule; that is what we compare against.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hf_reference import import_without_cuda_kernels

import transformers


import_without_cuda_kernels("transformers.models.qwen3_5.modeling_qwen3_5")

from transformers import (  # noqa: E402
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

from redlite.engine.base import EngineError  # noqa: E402
from redlite.layers.delta_rule import (  # noqa: E402
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from redlite.models.base import ContextOverflow  # noqa: E402
from redlite.models.qwen3_5 import (  # noqa: E402
    Qwen3_5Model,
    export_recurrent,
    import_recurrent,
    load_qwen3_5,
)

L, F = "linear_attention", "full_attention"
VOCAB = 97
PROMPT = 150  # longer than one 64-token chunk, not a multiple of it
DECODE_STEPS = 8
ATOL = 1e-4

PATTERNS = {
    "LLLF": dict(layer_types=[L, L, L, F]),
    "FL": dict(layer_types=[F, L], linear_num_key_heads=4, linear_num_value_heads=4),
    "LLLLLF_tied": dict(layer_types=[L] * 5 + [F], tie_word_embeddings=True),
}


def _text_config(**overrides) -> Qwen3_5TextConfig:
    layer_types = overrides.pop("layer_types")
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, initializer_range=0.05, layer_types=layer_types,
    )
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Make every parameter matter: non-trivial norm weights (the reference initialises the
    zero-centred norms to 0 and the gated norm to 1) and slow decays so the recurrent state
    carries information across chunk boundaries."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.005, 1.0, generator=gen).log())
            elif "norm" in name or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def _build(tmp_path_factory, name: str, multimodal: bool = False, **overrides):
    torch.manual_seed(0)
    text = _text_config(**overrides)
    if multimodal:
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text.hidden_size,
                      num_position_embeddings=16)
        ref = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision))
    else:
        ref = Qwen3_5ForCausalLM(text)
    _randomize(ref, seed=len(name))
    path = tmp_path_factory.mktemp(name)
    ref.save_pretrained(path)
    return ref.eval(), str(path)


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def pair(request, tmp_path_factory):
    ref, path = _build(tmp_path_factory, request.param, **dict(PATTERNS[request.param]))
    return ref, load_qwen3_5(path, "cpu", torch.float32)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return _build(tmp_path_factory, "rollback", layer_types=[L, F, L, L])[1]


@pytest.fixture(scope="module")
def model(model_path):
    return load_qwen3_5(model_path, "cpu", torch.float32)


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _cache_kwargs(ref, out) -> dict:
    """The reference's cache from ``out``, as the keyword its ``forward`` takes (transformers
    5.24 says ``cache``; earlier 5.x releases ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = out.past_key_values
    key = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    return {key: cache}


def _check_against_reference(ref, ours) -> None:
    ids = _prompt(PROMPT)
    with torch.inference_mode():
        state = ours.new_state(PROMPT + DECODE_STEPS + 1, "cpu", torch.float32)
        logits = ours(ids, state, all_logits=True)
        out = ref(input_ids=ids[None], use_cache=True)
        assert logits.shape == (PROMPT, VOCAB) and logits.dtype == torch.float32
        assert (out.logits[0] - logits).abs().max().item() < ATOL
        token = logits[-1].argmax()
        for _ in range(DECODE_STEPS):
            step = ours(token.view(1), state)
            out = ref(input_ids=token.view(1, 1), use_cache=True, **_cache_kwargs(ref, out))
            assert step.shape == (1, VOCAB)
            assert (out.logits[0, -1] - step[0]).abs().max().item() < ATOL
            token = step[0].argmax()
        assert state.n_past == PROMPT + DECODE_STEPS


def test_matches_transformers_prefill_and_decode(pair):
    ref, ours = pair
    # the tiny model must not be trivially flat, or the comparison proves nothing
    assert ours.norm.weight.abs().max() > 0.1
    _check_against_reference(ref, ours)


def test_multimodal_layout_loads_and_matches(tmp_path_factory):
    ref, path = _build(tmp_path_factory, "mm", multimodal=True, layer_types=[L, F, L])
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    ours = load_qwen3_5(path, "cpu", torch.float32)
    _check_against_reference(ref, ours)


def test_registry_resolves_both_layouts(model):
    from redlite.models import resolve_model_class

    assert resolve_model_class({"architectures": ["Qwen3_5ForCausalLM"]}) is Qwen3_5Model
    assert resolve_model_class({"architectures": ["Qwen3_5ForConditionalGeneration"]}) is Qwen3_5Model
    assert resolve_model_class({"model_type": "qwen3_5_text"}) is Qwen3_5Model


def test_generic_hf_loader_builds_it(model, model_path):
    from redlite.loading.hf import load_hf_model

    loaded, config = load_hf_model(model_path, "cpu", torch.float32)
    assert isinstance(loaded, Qwen3_5Model) and config["architectures"] == ["Qwen3_5ForCausalLM"]
    ids = _prompt(20)
    with torch.inference_mode():
        a = loaded(ids, loaded.new_state(20, "cpu", torch.float32))
        b = model(ids, model.new_state(20, "cpu", torch.float32))
    assert torch.equal(a, b)


def test_prefill_in_pieces_equals_one_piece(model):
    ids = _prompt(PROMPT, seed=2)
    with torch.inference_mode():
        whole = model(ids, model.new_state(PROMPT, "cpu", torch.float32), all_logits=True)
        for cuts in ([70], [1, 64, 128], [3, 4, 5, 149]):
            state = model.new_state(PROMPT, "cpu", torch.float32)
            bounds = [0, *cuts, PROMPT]
            parts = [model(ids[a:b], state, all_logits=True) for a, b in zip(bounds, bounds[1:])]
            assert state.n_past == PROMPT
            assert (torch.cat(parts) - whole).abs().max().item() < 1e-5, cuts


def test_decode_token_by_token_equals_prefill(model):
    ids = _prompt(70, seed=3)
    with torch.inference_mode():
        whole = model(ids, model.new_state(70, "cpu", torch.float32), all_logits=True)
        state = model.new_state(70, "cpu", torch.float32)
        steps = torch.cat([model(ids[i:i + 1], state) for i in range(70)])
    assert (steps - whole).abs().max().item() < 1e-5


def test_export_import_recurrent_rolls_back_exactly(model):
    p, x, y = _prompt(100, seed=4), _prompt(30, seed=5), _prompt(40, seed=6)
    with torch.inference_mode():
        state = model.new_state(256, "cpu", torch.float32)
        at_p = model(p, state)
        checkpoint = export_recurrent(state)
        assert state.n_past == 100
        model(x, state)
        for token in x[:3]:
            model(token.view(1), state)
        assert state.n_past == 133
        import_recurrent(state, checkpoint, 100)
        assert state.n_past == 100
        resumed = [model(y, state, all_logits=True)] + [model(t.view(1), state) for t in y[:4]]

        cold = model.new_state(256, "cpu", torch.float32)
        assert torch.equal(model(p, cold), at_p)
        cold_logits = [model(y, cold, all_logits=True)] + [model(t.view(1), cold) for t in y[:4]]
        # same split as the cold run: bit-for-bit the same computation
        for a, b in zip(resumed, cold_logits):
            assert torch.equal(a, b)
        # and one prefill of P+Y agrees up to float rounding
        single = model(torch.cat([p, y]), model.new_state(256, "cpu", torch.float32), all_logits=True)
        assert (single[100:] - resumed[0]).abs().max().item() < 1e-5


def test_checkpoint_payload_and_sizes(model):
    with torch.inference_mode():
        state = model.new_state(64, "cpu", torch.float32)
        model(_prompt(10), state)
        payload = state.export_recurrent()
    linear = [i for i, t in enumerate(model.layer_types) if t == L]
    assert sorted(payload) == sorted(f"layers.{i}.{k}" for i in linear for k in ("conv", "recurrent"))
    mixer = model.layers[linear[0]].linear_attn
    assert payload[f"layers.{linear[0]}.conv"].shape == (2 * 2 * 8 + 4 * 12, 3)
    assert payload[f"layers.{linear[0]}.recurrent"].shape == (4, 8, 12)
    assert payload[f"layers.{linear[0]}.recurrent"].dtype == torch.float32
    per_layer = mixer.conv_dim * 3 * 4 + 4 * 8 * 12 * 4
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    assert nbytes == state.recurrent_nbytes() == len(linear) * per_layer
    kv_per_token = 2 * 2 * 16 * 4  # one full layer: K and V, 2 heads x 16 dims, float32
    assert state.nbytes() == nbytes + 10 * kv_per_token
    # a copy, not a view
    assert payload[f"layers.{linear[0]}.recurrent"].data_ptr() != state.recurrent[linear[0]].data_ptr()
    assert torch.equal(payload[f"layers.{linear[0]}.recurrent"], state.recurrent[linear[0]])


def test_whole_state_export_and_load(model):
    ids, more = _prompt(90, seed=7), _prompt(20, seed=8)
    with torch.inference_mode():
        state = model.new_state(128, "cpu", torch.float32)
        model(ids, state)
        saved = state.export()
        assert all(t.device.type == "cpu" and t.is_contiguous() for t in saved.values())
        assert sum(t.numel() * t.element_size() for t in saved.values()) == state.nbytes()
        expected = model(more, state, all_logits=True)

        other = model.new_state(128, "cpu", torch.float32)
        other.load(saved, 90)
        assert other.n_past == 90
        assert torch.equal(model(more, other, all_logits=True), expected)

        with pytest.raises(EngineError):
            other.load({k: v for k, v in saved.items() if k != "kv"}, 90)
        with pytest.raises(EngineError):
            other.export(50)


def test_cannot_truncate_and_rollback_bounds(model):
    with torch.inference_mode():
        state = model.new_state(32, "cpu", torch.float32)
        model(_prompt(12), state)
        assert not state.can_truncate
        state.truncate(12)  # no-op allowed
        with pytest.raises(EngineError):
            state.truncate(5)
        payload = state.export_recurrent()
        with pytest.raises(EngineError):
            state.import_recurrent(payload, 13)
        first = model(_prompt(5, seed=11), model.new_state(32, "cpu", torch.float32))
        state.reset()
        assert state.n_past == 0
        assert torch.equal(model(_prompt(5, seed=11), state), first)
        model(_prompt(7), state)
        with pytest.raises(EngineError):
            state.import_recurrent({}, 12)
        assert state.n_past == 12


def test_context_overflow_leaves_state_untouched(model):
    with torch.inference_mode():
        state = model.new_state(20, "cpu", torch.float32)
        model(_prompt(15), state)
        before = state.export()
        with pytest.raises(ContextOverflow):
            model(_prompt(6), state)
        assert state.n_past == 15
        after = state.export()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("length,chunk", [(1, 64), (63, 64), (64, 64), (65, 64), (150, 64), (37, 8)])
def test_chunked_rule_equals_recurrent_rule(length, chunk):
    gen = torch.Generator().manual_seed(length)
    hk, hv, dk, dv = 2, 4, 8, 6
    q = l2_normalize(torch.randn(length, hk, dk, generator=gen)) / math.sqrt(dk)
    k = l2_normalize(torch.randn(length, hk, dk, generator=gen))
    v = torch.randn(length, hv, dv, generator=gen)
    g = -torch.rand(length, hv, generator=gen)
    beta = torch.rand(length, hv, generator=gen)
    s0 = 0.1 * torch.randn(hv, dk, dv, generator=gen)
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    assert o_chk.shape == (length, hv, dv) and s_chk.shape == (hv, dk, dv)
    assert (o_rec - o_chk).abs().max().item() < 1e-5
    assert (s_rec - s_chk).abs().max().item() < 1e-5
    assert torch.equal(s0, s0.clone())  # inputs untouched


def test_bfloat16_runs_close_to_float32(model, model_path):
    ids = _prompt(80, seed=9)
    half = load_qwen3_5(model_path, "cpu", torch.bfloat16)
    assert half.embed_weight.dtype == torch.bfloat16 and half.layers[0].linear_attn.A_log.dtype == torch.float32
    with torch.inference_mode():
        ref = model(ids, model.new_state(80, "cpu", torch.float32), all_logits=True)
        state = half.new_state(80, "cpu", torch.bfloat16)
        out = half(ids, state, all_logits=True)
    assert out.dtype == torch.float32
    assert state.recurrent[0].dtype == torch.float32 and state.conv[0].dtype == torch.bfloat16
    assert (out - ref).abs().max().item() < 0.05 * ref.abs().max().item() + 0.05


def test_missing_weight_raises_key_error(model_path):
    from safetensors.torch import load_file

    tensors = load_file(f"{model_path}/model.safetensors")
    del tensors["model.layers.2.linear_attn.A_log"]
    from redlite.loading.hf import read_config

    fresh = Qwen3_5Model(read_config(model_path))
    with pytest.raises(KeyError, match="A_log"):
        fresh.load_hf_weights(tensors)


# --- CUDA: the flash-linear-attention path (skipped without a GPU and the fla package) ----------

def _cuda_with_fla() -> bool:
    from redlite.layers.gated_deltanet import fla_available

    return torch.cuda.is_available() and fla_available(torch.device("cuda"))


needs_cuda_fla = pytest.mark.skipif(
    not _cuda_with_fla(), reason="needs CUDA and flash-linear-attention (not installed)")


@pytest.fixture(scope="module")
def cuda_pair(tmp_path_factory):
    # head dims of 64: the Triton kernels want dot-product tiles of at least 16
    ref, path = _build(tmp_path_factory, "cuda", layer_types=[L, L, F, L], linear_key_head_dim=64,
                       linear_value_head_dim=64, head_dim=32)
    return ref, path


def _run(model, ids, cuts, steps, device):
    """Logits of a prefill split at ``cuts`` then ``steps`` greedy decode steps."""
    state = model.new_state(len(ids) + steps + 1, device, model.embed_weight.dtype)
    bounds = [0, *cuts, len(ids)]
    out = [model(ids[a:b], state, all_logits=True) for a, b in zip(bounds, bounds[1:])]
    token = out[-1][-1].argmax()
    for _ in range(steps):
        out.append(model(token.view(1), state))
        token = out[-1][0].argmax()
    return torch.cat(out)


@pytest.mark.gpu
@needs_cuda_fla
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-2), (torch.bfloat16, 0.1)])
def test_cuda_fla_path_matches_torch_path(cuda_pair, monkeypatch, dtype, atol):
    """fla's kernels round through bf16/tf32 internally: on an H200 a float32 run differed
    from the PyTorch path by 4e-3 at logit scale 1.5, a bfloat16 run by 0.03."""
    import redlite.layers.gated_deltanet as gdn

    _, path = cuda_pair
    model = load_qwen3_5(path, "cuda", dtype)
    ids = _prompt(PROMPT).cuda()
    with torch.inference_mode():
        fla_logits = _run(model, ids, [], DECODE_STEPS, "cuda")
        fla_split = _run(model, ids, [70], DECODE_STEPS, "cuda")
        fla_short = _run(model, ids, [60, 61, 66, 80], DECODE_STEPS, "cuda")  # recurrent-kernel pieces
        monkeypatch.setattr(gdn, "_FLA_FUNCS", None)
        torch_logits = _run(model, ids, [], DECODE_STEPS, "cuda")
    scale = torch_logits.abs().max().item()
    print(f"{dtype}: fla vs torch {(fla_logits - torch_logits).abs().max().item():.3g}, "
          f"split {(fla_split - fla_logits).abs().max().item():.3g}, logit scale {scale:.3g}")
    assert (fla_logits - torch_logits).abs().max().item() < atol * max(1.0, scale)
    assert (fla_split - fla_logits).abs().max().item() < atol * max(1.0, scale)
    assert (fla_short - fla_logits).abs().max().item() < atol * max(1.0, scale)


@pytest.mark.gpu
@needs_cuda_fla
def test_cuda_rollback_with_fla(cuda_pair):
    _, path = cuda_pair
    model = load_qwen3_5(path, "cuda", torch.bfloat16)
    p, x, y = (_prompt(n, seed=s).cuda() for n, s in ((100, 4), (30, 5), (40, 6)))
    with torch.inference_mode():
        state = model.new_state(256, "cuda", torch.bfloat16)
        model(p, state)
        checkpoint = state.export_recurrent()
        model(x, state)
        model(x[:1], state)
        state.import_recurrent(checkpoint, 100)
        resumed = torch.cat([model(y, state, all_logits=True), model(y[:1], state)])
        cold = model.new_state(256, "cuda", torch.bfloat16)
        model(p, cold)
        expected = torch.cat([model(y, cold, all_logits=True), model(y[:1], cold)])
    assert (resumed - expected).abs().max().item() < 1e-5
