"""The bundled SmolLM2-135M (Q4_1, fused C decode step) as a pool: four conversations decoded
together through ``decode_batch`` give bitwise the logits of each decoded alone."""

from __future__ import annotations

import pytest
import torch

from redlite.engine.torch_engine import TorchEngine
from redlite.kernels import native
from redlite.loading.bundled import bundled_model_path
from redlite.loading.gguf import resolve_model_dir
from redlite.loading.hf import load_hf_model
from redlite.loading.tokenizer import load_tokenizer
from test_slot_pool import assert_same, greedy_alone

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Say hello in Japanese and in Chinese, then explain the words."]


def test_bundled_model_batch_is_bitwise_alone():
    model_dir = resolve_model_dir(bundled_model_path())
    model, _ = load_hf_model(model_dir, "cpu", torch.float32)
    tokenizer = load_tokenizer(model_dir)
    feeds = [tokenizer.encode(text) for text in PROMPTS]
    pool = TorchEngine(model, ctx_size=256, device="cpu")
    assert pool.model._fused() is not None
    slots = [pool] + [pool.new_slot() for _ in feeds[1:]]
    alone = TorchEngine(model, ctx_size=256, device="cpu")
    steps = 12
    want, _fed = greedy_alone(alone, feeds, steps)
    got = [[slot.prefill(ids)] for slot, ids in zip(slots, feeds)]
    for _ in range(steps):
        rows = pool.decode_batch(slots, [int(g[-1].argmax()) for g in got])
        for g, row in zip(got, rows):
            g.append(row)
    assert_same(got, want, exact=True)
