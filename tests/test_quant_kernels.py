"""The C kernels of GGUF block formats against gguf's own dequantization (the reference).

Blocks are random bytes with sane fp16 scales (every bit pattern of the codes is a valid
block), for each format the kernels take. Checked: dequantization equals
``gguf.quants.dequantize`` exactly; the float32-activation product is within
:func:`float32_error_bound` (float32 rounding) of the exact product of the dequantized weight;
the 8- and 16-bit-activation products equal the float64 product of the dequantized weight and
the rounded activations up to float32 rounding, and stay within
:func:`activation_rounding_bound` of the float32 product with the exact activations; the
many-token 16-bit product (AVX512-VNNI CPUs) equals the one-token one up to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from redlite.kernels import native
from redlite.layers.quant_weight import (BF16_MIN_TOKENS, GEMM_FORMATS, KERNEL_FORMATS, SMALL_BATCH, QuantTensor,
                                         QuantWeight, ACTIVATION_LEVELS, activation_rounding_bound,
                                         float32_error_bound)

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")

BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
         "Q6_K": (256, 210)}
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """Random codes, fp16 scales (and mins) near the magnitudes real files hold."""
    values, nbytes = BLOCK[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in SCALES[qtype]:
        scale = rng.uniform(2e-4, 4e-3, size=data.shape[:2]).astype(np.float16)
        data[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return QuantTensor(qtype, (rows, cols), data.reshape(rows, -1))


def rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """The activations as the kernel sees them: per 32 values, ``round(x / d) * d`` with
    ``d = max|x| / levels``."""
    blocks = x.double().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / levels
    return (torch.round(blocks / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


@pytest.mark.parametrize("qtype", sorted(KERNEL_FORMATS))
def test_dequantize_equals_gguf(qtype: str) -> None:
    block = random_blocks(qtype, rows=24, cols=512)
    weight = QuantWeight([block])
    np.testing.assert_array_equal(weight.dequantize().numpy(), block.dequantize())
    ids = torch.tensor([5, 0, 23, 5])
    np.testing.assert_array_equal(weight.rows(ids).numpy(), block.dequantize()[ids.numpy()])


@pytest.mark.parametrize("qtype", sorted(KERNEL_FORMATS))
def test_float32_product_is_the_dequantized_product(qtype: str) -> None:
    rows, cols = 40, 768
    block = random_blocks(qtype, rows, cols, seed=1)
    dense = torch.from_numpy(block.dequantize())
    x = torch.randn(SMALL_BATCH, cols, generator=torch.Generator().manual_seed(2))
    got = QuantWeight([block], "float32").linear(x)
    for t in range(SMALL_BATCH):
        exact = dense.double() @ x[t].double()
        assert bool(((got[t].double() - exact).abs() <= float32_error_bound(dense, x[t])).all()), qtype
    bias = torch.randn(rows)
    torch.testing.assert_close(QuantWeight([block], "float32").linear(x[:1], bias), got[:1] + bias, rtol=0, atol=0)


@pytest.mark.parametrize("activations", ["q8", "q16"])
@pytest.mark.parametrize("qtype", sorted(KERNEL_FORMATS))
def test_rounded_activation_product_matches_the_dequantized_reference(qtype: str, activations: str) -> None:
    rows, cols, levels = 40, 768, ACTIVATION_LEVELS[activations]
    block = random_blocks(qtype, rows, cols, seed=1)
    weight = QuantWeight([block], activations=activations)
    dense = torch.from_numpy(block.dequantize())
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    x[1, 40:72] *= 50  # an outlier block, as hidden states have
    got = weight.linear(x)
    for t in range(3):
        # up to float32 rounding, the product with the rounded activations the kernel uses
        # (q16: the mins and offsets take the exact block sums, hence the bound below)
        want_rounded = dense.double() @ rounded(x[t], levels)
        scale = (dense.double().abs() @ rounded(x[t], levels).abs()).max()
        slack = 1e-5 * scale + (activation_rounding_bound(dense, x[t], levels) if activations == "q16" else 0)
        assert bool(((got[t].double() - want_rounded).abs() <= slack).all()), qtype
        # within the stated bound of the float32 reference with the exact activations
        want = dense @ x[t]
        bound = activation_rounding_bound(dense, x[t], levels) + 1e-5 * scale
        assert bool(((got[t].double() - want.double()).abs() <= bound).all()), qtype
    if activations == "q16":  # 256 times finer than q8: far nearer the float32 product
        q8 = QuantWeight([block], activations="q8").linear(x)
        exact = (dense.double() @ x.double().T).T
        assert (got.double() - exact).abs().max() * 20 < (q8.double() - exact).abs().max()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_q16_product_with_an_odd_number_of_blocks(qtype: str) -> None:
    """Q4_0/Q4_1 take blocks two at a time; the last of an odd count goes alone."""
    rows, cols = 24, 32 * 5
    block = random_blocks(qtype, rows, cols, seed=8)
    dense = torch.from_numpy(block.dequantize())
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(9))
    got = QuantWeight([block], activations="q16").linear(x)
    for t in range(2):
        scale = (dense.double().abs() @ x[t].double().abs()).max()
        bound = activation_rounding_bound(dense, x[t], ACTIVATION_LEVELS["q16"]) + 1e-5 * scale
        assert bool(((got[t].double() - dense.double() @ x[t].double()).abs() <= bound).all()), qtype


def test_stacked_parts_of_mixed_formats_and_prefill_path() -> None:
    cols = 512
    blocks = [random_blocks("Q4_K", 16, cols, 3), random_blocks("Q6_K", 8, cols, 4),
              random_blocks("Q8_0", 8, cols, 5)]
    weight = QuantWeight(blocks)
    assert weight.shape == (32, cols)
    dense = torch.cat([torch.from_numpy(b.dequantize()) for b in blocks])
    torch.testing.assert_close(weight.dequantize(), dense, rtol=0, atol=0)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(6))
    for activations in ACTIVATION_LEVELS:
        one = QuantWeight(blocks, activations).linear(x)[0]
        separate = torch.cat([QuantWeight([b], activations).linear(x)[0] for b in blocks])
        torch.testing.assert_close(one, separate, rtol=0, atol=0)
    # more rows than SMALL_BATCH: dequantized float32 product, the reference itself
    many = torch.randn(SMALL_BATCH + 3, cols, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(32)
    torch.testing.assert_close(weight.linear(many, bias), torch.nn.functional.linear(many, dense, bias))


def test_zero_activations_give_zero() -> None:
    for activations in ACTIVATION_LEVELS:
        weight = QuantWeight([random_blocks("Q4_1", 8, 256)], activations)
        assert torch.equal(weight.linear(torch.zeros(1, 256)), torch.zeros(1, 8))


@pytest.mark.skipif(not native.has_vnni512(), reason="the many-token q16 kernel needs AVX512-VNNI")
@pytest.mark.parametrize("qtype", GEMM_FORMATS)
def test_q16_prefill_equals_the_q16_rows(qtype: str) -> None:
    # 45 rows: a ragged last group of 16 rows; 11 tokens: a ragged last tile; a second part
    cols = 512
    blocks = [random_blocks(qtype, 29, cols, 8), random_blocks("Q8_0" if qtype != "Q8_0" else "Q4_1", 16, cols, 9)]
    weight = QuantWeight(blocks, "q16", prefill="q16")
    assert weight.prefill == "q16"
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(10))
    x[3, 64:96] = 0  # an all-zero block
    bias = torch.randn(45)
    got = weight.linear(x, bias)
    want = torch.cat([weight.linear(x[t:t + 1], bias) for t in range(x.shape[0])])
    dense = torch.cat([torch.from_numpy(b.dequantize()) for b in blocks])
    scale = (dense.abs() @ x.abs().T).T
    assert bool(((got - want).abs() <= 1e-5 * scale + 1e-6).all()), qtype
    assert QuantWeight([random_blocks("Q6_K", 8, cols)], prefill="q16").prefill == "float32"


@pytest.mark.parametrize("qtype", sorted(KERNEL_FORMATS))
def test_bfloat16_dequantization_is_the_float32_one_rounded(qtype: str) -> None:
    # 23 rows over two parts; values near bfloat16 ties come from the random codes and scales
    blocks = [random_blocks(qtype, 15, 512, 11), random_blocks(qtype, 8, 512, 12)]
    weight = QuantWeight(blocks)
    assert torch.equal(weight.dequantize_bf16(), weight.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_bf16_prefill_is_the_bfloat16_product_from_its_token_count(qtype: str) -> None:
    cols = 512
    weight = QuantWeight([random_blocks(qtype, 40, cols, 13)], "q16", prefill="bf16")
    assert weight.prefill == "bf16"  # Q6_K too: no q16 GEMM needed
    bias = torch.randn(40)
    x = torch.randn(BF16_MIN_TOKENS, cols, generator=torch.Generator().manual_seed(14))
    want = torch.nn.functional.linear(x.bfloat16(), weight.dequantize().bfloat16()).float() + bias
    assert torch.equal(weight.linear(x, bias), want)
    # fewer tokens: the q16 (or float32) product, close to the float32 one as before
    few = x[:BF16_MIN_TOKENS - 1]
    dense = weight.dequantize()
    scale = (dense.abs() @ few.abs().T).T
    assert bool(((weight.linear(few) - few @ dense.T).abs() <= 1e-4 * scale + 1e-5).all())


@pytest.mark.skipif(not native.has_vnni512(), reason="the VNNI decode rows need AVX512-VNNI")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_vnni_decode_rows_equal_the_avx2_rows(qtype: str) -> None:
    # the same integer sums per sub-block, scaled and added in float32 in another order
    cols = 768  # three super-blocks of 256 values
    weight = QuantWeight([random_blocks(qtype, 37, cols, 15), random_blocks("Q8_0", 5, cols, 16)], "q16")
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(17))
    lib = native.library()
    try:
        assert lib.q16_use_vnni(0) == 0
        avx2 = weight.linear(x)
        assert lib.q16_use_vnni(1) == 1
        vnni = weight.linear(x)
    finally:
        lib.q16_use_vnni(1)
    dense = weight.dequantize()
    scale = (dense.abs() @ x.abs().T).T
    assert bool(((vnni - avx2).abs() <= 1e-5 * scale + 1e-6).all())
