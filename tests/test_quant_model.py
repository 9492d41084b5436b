"""The bundled SmolLM2-135M (Q4_1 GGUF) kept quantized against its float32 dequantization.

The reference is the same file with every tensor dequantized at load
(``load_hf_model(keep_quantized=False)``): the former float32 path. One-token products go
through the quantized kernels on 16-bit activations (the default) or float32 ones (bounded per
product in test_quant_kernels.py); prefill products go on the same 16-bit activations where the
CPU has AVX512-VNNI, else, and in the float32 case, by the dequantized weights as the
reference does; prompts of BF16_MIN_TOKENS tokens or more take bfloat16 products where the CPU
has AMX (the default there; the long-prompt test runs both forms). Either way the greedy text
of the regression prompts must not change.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from redlite.engine.torch_engine import TorchEngine
from redlite.kernels import native
from redlite.loading.bundled import bundled_model_path
from redlite.loading.gguf import resolve_model_dir
from redlite.loading.hf import load_hf_model, weight_formats
from redlite.loading.tokenizer import load_tokenizer

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")]

PROMPTS = ["What is the capital of France?",
           "Translate to French: I love the coffee shop and the summer.",
           "Say hello in Japanese and in Chinese."]
# Logits (spanning about 30) against the reference. float32 activations: float32 rounding in
# another order of additions through 30 layers, measured ~2e-5 (8e-5 over 8 prompts x 48
# tokens). 16-bit ones: each activation off by up to 1/65534 of its 32-value block's largest,
# measured 5e-3 here (1.2e-2 over 8 prompts x 48 tokens, text unchanged); 8-bit ones (llama.cpp's)
# move them by ~0.1 and change the text of half those prompts; a wrong block layout by units.
LOGIT_TOLERANCE = {"float32": 1e-3, "q16": 2.5e-2, "bf16": 1.0}
# bf16 prefill (prompts of BF16_MIN_TOKENS tokens or more, where the CPU has AMX): each weight
# and activation of the prompt's products rounded to 2**-9 of itself (128x q16's step), summed
# in float32; measured 0.27-0.33 on the three long prompts below, the text unchanged.
LONG_TEXT = ("The Rhine is one of the major European rivers. It begins in the Swiss canton of Graubunden in "
             "the southeastern Swiss Alps, forms part of the Swiss-Liechtenstein, Swiss-Austrian and "
             "Swiss-German borders, and then flows through the German Rhineland and the Netherlands and "
             "eventually empties into the North Sea. ") * 3
LONG_PROMPTS = [LONG_TEXT + "Summarize the text above in one sentence.",
                LONG_TEXT + "Which countries does the river flow through?",
                "Write a short story about a lighthouse keeper. " * 20 + "Begin."]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(bundled_model_path())


@pytest.fixture(scope="module")
def engines(model_dir):
    quant, _ = load_hf_model(model_dir, "cpu", torch.float32)
    reference, _ = load_hf_model(model_dir, "cpu", torch.float32, keep_quantized=False)
    return (TorchEngine(quant, ctx_size=1024, device="cpu"), TorchEngine(reference, ctx_size=1024, device="cpu"))


def _greedy(engine: TorchEngine, ids: list[int], n: int, logits_out: list) -> list[int]:
    logits = engine.prefill(ids)
    out = []
    for _ in range(n):
        logits_out.append(logits)
        token = int(logits.argmax())
        out.append(token)
        if token == 2:  # <|im_end|>
            break
        logits = engine.decode(token)
    return out


def test_weights_stay_quantized(engines) -> None:
    quant, reference = engines
    assert weight_formats(quant.model) == {"quantized Q4_1": 120, "quantized Q8_0": 1}
    assert weight_formats(reference.model) == {"dense float32": 121}
    assert quant.fingerprint() != reference.fingerprint()


def _use(engine: TorchEngine, activations: str) -> None:
    """Decode ``engine``'s quantized products on ``activations`` (and prefill on float32 ones
    with float32 activations, else on the default form)."""
    from redlite.layers.cpu_decode import FusedDecode

    from redlite.layers.quant_weight import PREFILL_ACTIVATIONS

    for module in engine.model.modules():
        if getattr(module, "is_quantized", False):
            module.activations = activations
            module.prefill = "float32" if activations == "float32" else PREFILL_ACTIVATIONS
    engine.model._fused_decode = FusedDecode.build(engine.model, activations=activations)


@pytest.mark.parametrize("activations", ["q16", "float32"])
def test_greedy_text_equals_the_float32_reference(engines, model_dir, activations) -> None:
    _use(engines[0], activations)
    tokenizer = load_tokenizer(model_dir)
    for prompt in PROMPTS:
        got = _same_greedy_text(engines, tokenizer.render_chat([{"role": "user", "content": prompt}]).token_ids,
                                LOGIT_TOLERANCE[activations])
        if prompt == PROMPTS[0]:
            assert "Paris" in tokenizer.decode(got)


_REFERENCE_RUNS: dict[tuple[int, ...], tuple[list[int], list]] = {}


def _same_greedy_text(engines, ids: list[int], tolerance: float) -> list[int]:
    """32 greedy tokens after ``ids`` on both engines: the same tokens, and every step's logits
    within ``tolerance`` of the reference's. Returns the tokens. The reference's run of a
    prompt is computed once per module (it never changes; the quantized engine's forms do)."""
    quant, reference = engines
    got_logits = []
    quant.reset()
    got = _greedy(quant, ids, 32, got_logits)
    if tuple(ids) not in _REFERENCE_RUNS:
        reference.reset()
        want_logits = []
        _REFERENCE_RUNS[tuple(ids)] = (_greedy(reference, ids, 32, want_logits), want_logits)
    want, want_logits = _REFERENCE_RUNS[tuple(ids)]
    assert got == want
    worst = max(float((a - b).abs().max()) for a, b in zip(got_logits, want_logits))
    assert worst <= tolerance, worst
    return got


@pytest.mark.parametrize("form", ["q16", "bf16"])
def test_long_prompts_greedy_text_equals_the_float32_reference(engines, model_dir, form) -> None:
    from redlite.layers.quant_weight import BF16_MIN_TOKENS

    _use(engines[0], "q16")
    for module in engines[0].model.modules():
        if getattr(module, "is_quantized", False):
            module.prefill = form
    tokenizer = load_tokenizer(model_dir)
    for prompt in LONG_PROMPTS:
        ids = tokenizer.render_chat([{"role": "user", "content": prompt}]).token_ids
        assert len(ids) >= BF16_MIN_TOKENS
        _same_greedy_text(engines, ids, LOGIT_TOLERANCE[form])


@pytest.mark.parametrize("activations", ["q16", "float32"])
def test_second_turn_on_held_state_equals_reference(engines, model_dir, activations) -> None:
    quant, reference = engines
    _use(quant, activations)
    tokenizer = load_tokenizer(model_dir)
    turn = [{"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "Name a large river in Europe."}]
    results = []
    for engine in (quant, reference):
        engine.reset()
        first_ids = tokenizer.render_chat(turn).token_ids
        answer = _greedy(engine, first_ids, 24, [])
        follow = turn + [{"role": "assistant", "content": tokenizer.decode(answer)},
                         {"role": "user", "content": "How long is it?"}]
        ids = tokenizer.render_chat(follow).token_ids
        common = 0
        while common < min(len(ids), engine.n_past) and ids[common] == (first_ids + answer)[common]:
            common += 1
        engine.rewind(common)
        second = _greedy(engine, ids[common:], 24, [])
        results.append((answer, second))
    assert results[0] == results[1]


def _rss_after_load(keep_quantized: bool) -> int:
    code = ("import re, torch; from redlite.loading.hf import load_hf_model; "
            f"model = load_hf_model({str(resolve_model_dir(bundled_model_path()))!r}, 'cpu', torch.float32, "
            f"keep_quantized={keep_quantized}); "
            "print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True)
    return int(done.stdout.split()[-1]) * 1024


def test_resident_memory_far_below_the_float32_load() -> None:
    quant, dense = _rss_after_load(True), _rss_after_load(False)
    gguf_bytes = bundled_model_path().stat().st_size
    # float32 weights are ~540 MB; quantized ones stay in the 98 MB file mapping
    assert dense - quant > 4 * gguf_bytes, (quant, dense)
