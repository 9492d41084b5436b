"""The fused C decode step against the torch decode of the same model (tiny random Llama-family
models: q/k/v biases, q/k norm, a sliding window, dense F32 rows and quantized blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from redlite.kernels import native
from redlite.layers.cpu_decode import FusedDecode
from redlite.layers.quant_weight import QuantTensor, QuantWeight
from redlite.models.llama import LlamaModel

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")

BASE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def _model(**extra) -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel({**BASE, **extra})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.eval()


def _q8_0(weight: torch.Tensor) -> QuantTensor:
    """``weight`` [rows, cols] as Q8_0 blocks (gguf's quantizer)."""
    import gguf

    data = gguf.quants.quantize(weight.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    return QuantTensor("Q8_0", tuple(weight.shape), data.reshape(weight.shape[0], -1))


def _decode_both(model: LlamaModel, fused: FusedDecode, steps: int = 12, cache_tol: float = 1e-5,
                 prompt: torch.Tensor | None = None, kv_dtype: torch.dtype = torch.float32) -> float:
    """The fused step and the torch decode from the same torch prefill, ``steps`` tokens each on
    its own state (caches of ``kv_dtype``); returns the largest logit difference."""
    prompt = torch.tensor([3, 17, 42, 5, 88, 1, 60]) if prompt is None else prompt
    size = len(prompt) + steps + 8
    worst = 0.0
    with torch.inference_mode():
        a, b = (model.new_state(size, "cpu", torch.float32, kv_dtype=kv_dtype) for _ in range(2))
        model._fused_decode = False
        model(prompt, a)
        model(prompt, b)
        token = 7
        for _ in range(steps):
            model._fused_decode = fused
            got = model(torch.tensor([token]), a)
            model._fused_decode = False
            want = model(torch.tensor([token]), b)
            worst = max(worst, float((got - want).abs().max()))
            token = int(want.argmax())
        assert a.n_past == b.n_past
        n = a.n_past
        torch.testing.assert_close(a.cache.data[:, :, :, :n], b.cache.data[:, :, :, :n], rtol=cache_tol,
                                   atol=cache_tol)
    return worst


@pytest.mark.parametrize("extra", [{"model_type": "llama"},
                                   {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
                                    "max_window_layers": 1},
                                   {"model_type": "qwen3", "tie_word_embeddings": True}])
def test_fused_step_equals_torch_decode(extra) -> None:
    model = _model(**extra)
    assert FusedDecode.build(model) is None  # dense weights only: the torch path stays
    fused = FusedDecode.build(model, require_quantized=False)
    assert fused is not None
    assert _decode_both(model, fused) < 1e-4


@pytest.mark.parametrize("extra", [{"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 2},
                                   {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 150,
                                    "max_window_layers": 1},
                                   {"model_type": "llama", "head_dim": 64},  # values summed 64 columns at a time
                                   {"model_type": "llama", "head_dim": 128, "num_attention_heads": 2,
                                    "num_key_value_heads": 1}])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_fused_step_over_a_long_cache(extra, kv_dtype) -> None:
    """Attention over hundreds of cache rows: several spans per head merged (decode_attention.c),
    grouped query heads, a window whose start is not a span boundary; a float32 or a float16
    cache (both paths read the same rounded values: a cache row may differ by one float16 step
    where its float32 value differs in the last bits)."""
    model = _model(**extra, max_position_embeddings=1024)
    fused = FusedDecode.build(model, require_quantized=False)
    prompt = torch.randint(0, BASE["vocab_size"], (437,), generator=torch.Generator().manual_seed(1))
    cache_tol = 1e-5 if kv_dtype == torch.float32 else 2e-3
    assert _decode_both(model, fused, steps=6, prompt=prompt, kv_dtype=kv_dtype, cache_tol=cache_tol) < 1e-4


def test_a_float16_cache_holds_the_rounded_float32_rows() -> None:
    """The fused step writes each key and value row as torch's copy into a float16 cache rounds
    it (to nearest-even): the first layer's rows of a first token (which no rounded value has
    touched yet) are, bitwise, a float32 cache's rows rounded afterwards."""
    model = _model(model_type="llama")
    fused = FusedDecode.build(model, require_quantized=False)
    with torch.inference_mode():
        for token in (3, 17, 42):
            wide, half = (model.new_state(4, "cpu", torch.float32, kv_dtype=d) for d in (torch.float32, torch.float16))
            for state in (wide, half):
                fused(token, state)
            assert torch.equal(half.cache.data[0, :, :, 0], wide.cache.data[0, :, :, 0].half())


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_batch_row_over_a_long_cache_equals_the_step_alone(kv_dtype) -> None:
    model = _model(model_type="llama")
    fused = FusedDecode.build(model, require_quantized=False)
    lengths, token = (300, 5, 131), 11
    with torch.inference_mode():
        model._fused_decode = False
        states = []
        for n in lengths:
            state = model.new_state(n + 4, "cpu", torch.float32, kv_dtype=kv_dtype)
            model(torch.randint(0, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)), state)
            states.append(state)
        copies = [model.new_state(s.max_tokens, "cpu", torch.float32, kv_dtype=kv_dtype) for s in states]
        for copy, state in zip(copies, states):
            copy.cache.data.copy_(state.cache.data)
            copy.n_past = state.n_past
        batch = fused.batch([token] * len(states), states)
        alone = torch.cat([fused(token, copy) for copy in copies])
    assert torch.equal(batch, alone)


def test_fused_step_with_quantized_matrices() -> None:
    model = _model(model_type="llama")
    for layer in model.layers:
        for owner, name in ((layer.attn, "qkv_weight"), (layer.mlp, "gate_up_weight"), (layer.mlp, "down_weight")):
            weight = getattr(owner, name).detach().clone()
            delattr(owner, name)
            setattr(owner, name, QuantWeight([_q8_0(weight)], "float32"))
    fused = FusedDecode.build(model, activations="float32")
    assert fused is not None
    assert _decode_both(model, fused) < 1e-4


@pytest.mark.parametrize("activations,tol", [("q16", 2e-3), ("q8", 0.5)])
def test_rounded_activations_stay_close(activations, tol) -> None:
    """Steps on 16-bit (the default) or 8-bit activations (llama.cpp's) against the torch
    decode on float32 activations: near, not equal; 16-bit far nearer."""
    model = _model(model_type="llama")
    for layer in model.layers:
        weight = layer.mlp.gate_up_weight.detach().clone()
        delattr(layer.mlp, "gate_up_weight")
        layer.mlp.gate_up_weight = QuantWeight([_q8_0(weight)], "float32")
    worst = _decode_both(model, FusedDecode.build(model, activations=activations), steps=4, cache_tol=tol)
    assert 1e-7 < worst < tol
