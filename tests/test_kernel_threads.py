"""Who runs on the threads when a CPU engine decodes through the fused C step
(:func:`redlite.kernels.native.claim_threads`): the kernels' pool on all of them, torch's own
ops on one except inside a prefill. With torch's ops on two threads after each decode step,
torch's OpenMP worker spun on the core the pool's worker needed: the bundled model decoded
slower on 2 threads than on 1.

Run in a fresh interpreter: the claim is process-wide and lasts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redlite.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")

SRC = Path(__file__).resolve().parent.parent / "src"
SCRIPT = r"""
import json, sys
import gguf, numpy as np, torch
from redlite.engine.torch_engine import TorchEngine
from redlite.kernels import native
from redlite.layers.quant_weight import QuantTensor, QuantWeight
from redlite.models.llama import LlamaModel

torch.set_num_threads(2)
torch.manual_seed(0)
model = LlamaModel({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "model_type": "llama"})
with torch.no_grad():
    for p in model.parameters():
        p.copy_(0.2 * torch.randn_like(p))
quantized = sys.argv[1] == "q8_0"
if quantized:
    for layer in model.layers:
        weight = layer.mlp.down_weight.detach().clone()
        data = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
        delattr(layer.mlp, "down_weight")
        layer.mlp.down_weight = QuantWeight([QuantTensor("Q8_0", tuple(weight.shape),
                                                         data.reshape(weight.shape[0], -1))], "float32")
seen = {"after_load": torch.get_num_threads()}
forward = model.forward
def spy(ids, state, *a, **k):
    seen.setdefault("prefill" if ids.shape[0] > 1 else "decode", torch.get_num_threads())
    return forward(ids, state, *a, **k)
model.forward = spy
engine = TorchEngine(model, ctx_size=64, device="cpu")
seen["after_engine"] = torch.get_num_threads()
logits = engine.prefill([3, 17, 42, 5])
seen["after_prefill"] = torch.get_num_threads()
engine.decode(int(logits.argmax()))
seen["pool"] = native.library().get_threads()
print(json.dumps(seen))
"""


def _threads(weights: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, weights], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_a_fused_decode_engine_gives_the_threads_to_the_pool() -> None:
    assert _threads("q8_0") == {"after_load": 2, "after_engine": 1, "prefill": 2, "after_prefill": 1,
                                "decode": 1, "pool": 2}


@pytest.mark.timeout(180)
def test_a_torch_decode_engine_keeps_torch_threads() -> None:
    seen = _threads("dense")
    assert seen == {"after_load": 2, "after_engine": 2, "prefill": 2, "after_prefill": 2, "decode": 2,
                    "pool": 2}
