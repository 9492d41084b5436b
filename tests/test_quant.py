"""Quantized GGUF weights: block decoding, the int4 layout, the Linear layer, model parity.

Tolerances (stated per path, measured on the bundled model, justified by the arithmetic):

* GGUF blocks -> 4-bit parts -> float32: equal to ``gguf.quants.dequantize`` bit for bit for
  Q4_0, Q4_1, Q8_0, Q4_K (the same products and one rounding) and within 1 float32 ulp of the
  weight for Q5_K (its high bit is a second part: two roundings).
* Prefill (more than ``KERNEL_MAX_ROWS`` rows): the float32 product of those exact weights,
  so the logits equal the float32-dequantized reference model's up to summation order
  (``atol 1e-4``; measured 0).
* Decode (the int4 kernel): activations and scales are rounded to bfloat16 (relative 2**-9
  each) in every product of 30 layers; the logits stay within ``0.35 x`` the reference
  logits' standard deviation (measured at most 0.28) and the greedy token is the same.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from redlite.layers import quant_int4
from redlite.layers.linear import Linear
from redlite.loading.gguf_quant import QuantizedTensor

ROWS, COLS = 128, 512


def _quantized(kind: str, seed: int = 0) -> QuantizedTensor:
    rng = np.random.default_rng(seed)
    if kind in ("Q4_K", "Q5_K"):  # gguf.quants cannot quantize K-quants: random valid blocks
        size = {"Q4_K": 144, "Q5_K": 176}[kind]
        raw = rng.integers(0, 256, (ROWS, COLS // 256, size), dtype=np.uint8)
        raw[..., 0:2] = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        raw[..., 2:4] = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        raw = raw.reshape(ROWS, -1)
    else:
        weights = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])
    return QuantizedTensor(kind, (ROWS, COLS), raw)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K"])
def test_int4_parts_rebuild_the_gguf_values(kind: str) -> None:
    tensor = _quantized(kind)
    reference = tensor.dequantize()
    parts, offset = tensor.int4_parts()
    rebuilt = np.repeat(offset, 32, axis=1)
    for codes, scale in parts:
        assert codes.dtype == np.uint8 and codes.max() <= 15
        rebuilt = rebuilt + codes.astype(np.float32) * np.repeat(scale, 32, axis=1)
    if kind == "Q5_K":
        np.testing.assert_allclose(rebuilt, reference, rtol=2 ** -23, atol=1e-6)
    else:
        np.testing.assert_array_equal(rebuilt, reference)
    # and through the packed weight held by the layer
    weight = quant_int4.Int4Weight.from_parts([tensor.int4_parts()])
    got = weight.dequantize()
    torch.testing.assert_close(got, torch.from_numpy(reference), rtol=2 ** -23, atol=1e-6)
    rows = torch.tensor([0, 33, 64, 127, 5])
    assert torch.equal(weight.rows(rows), got[rows])


def test_formats_without_a_4bit_form() -> None:
    rng = np.random.default_rng(1)
    q6 = QuantizedTensor("Q6_K", (64, 256), rng.integers(0, 256, (64, 210), dtype=np.uint8))
    assert q6.int4_parts() is None  # 16-value sub-blocks: the kernel's groups are >= 32


def test_pack_matches_torch_and_unpacks() -> None:
    assert quant_int4.layout_matches_torch()
    codes = torch.randint(0, 16, (192, 96), dtype=torch.uint8)
    packed = quant_int4.pack(codes)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
    assert torch.equal(quant_int4.unpack(packed), codes)
    rows = torch.tensor([0, 31, 32, 63, 64, 191])
    assert torch.equal(quant_int4.unpack_rows(packed, rows), codes[rows])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K"])
def test_linear_keeps_quantized_weights_and_multiplies(kind: str) -> None:
    q, k = _quantized(kind, 2), _quantized(kind, 3)
    layer = Linear(COLS, 2 * ROWS, bias=True)
    bias = torch.randn(2 * ROWS)
    layer.load([q, k], [bias[:ROWS], bias[ROWS:]])
    assert layer.weight is None and layer.format == f"{kind}:int4"
    dense = torch.cat([torch.from_numpy(q.dequantize()), torch.from_numpy(k.dequantize())])
    x = torch.randn(20, COLS)
    want = x @ dense.T + bias
    # many rows: dequantized float32 weights
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
    # few rows: the int4 kernel in bfloat16 (relative 2**-9 per activation and scale)
    got = layer(x[:1])
    scale = (x[:1].abs() @ dense.abs().T).max()
    assert (got - want[:1]).abs().max() <= 2 ** -7 * scale
    assert torch.equal(layer.rows(torch.tensor([3, 200])), dense[[3, 200]])


def test_linear_dequantizes_what_has_no_kernel() -> None:
    rng = np.random.default_rng(4)
    q6 = QuantizedTensor("Q6_K", (64, 256), rng.integers(0, 256, (64, 210), dtype=np.uint8))
    q6.data.reshape(64, 1, 210)[..., 208:210] = np.array([0.01], np.float16).view(np.uint8)
    layer = Linear(256, 64)
    layer.load([q6])
    assert layer.weight is not None and layer.format == "Q6_K:dequantized"
    assert torch.equal(layer.weight, torch.from_numpy(q6.dequantize()))


@pytest.mark.model
def test_bundled_model_parity_with_float32_reference(tmp_path) -> None:
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.gguf_tensors import GGUFTensors
    from redlite.loading.hf import load_hf_model, weight_formats
    from redlite.models.llama import LlamaModel

    directory = resolve_model_dir(bundled_model_path())
    config = json.loads((directory / "config.json").read_text())
    model, _ = load_hf_model(directory, "cpu", torch.float32)
    assert weight_formats(model) == {"Q4_1:int4": 120, "Q8_0:int4": 1}
    dense = {name: torch.from_numpy(v.dequantize()) if hasattr(v, "int4_parts") else v
             for name, v in GGUFTensors(directory / "model.gguf", config).items()}
    reference = LlamaModel(config)
    reference.load_hf_weights(dense)
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 1780, 314, 260,
                        3575, 282, 4649, 47, 2, 198])
    with torch.inference_mode():
        got = model(ids, model.new_state(64, "cpu", torch.float32), all_logits=True)
        want = reference(ids, reference.new_state(64, "cpu", torch.float32), all_logits=True)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        state, ref_state = model.new_state(64, "cpu", torch.float32), reference.new_state(64, "cpu", torch.float32)
        for token in ids:
            got, want = model(token[None], state), reference(token[None], ref_state)
            assert (got - want).abs().max() <= 0.35 * want.std()
            assert int(got.argmax()) == int(want.argmax())
