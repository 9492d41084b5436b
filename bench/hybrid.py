"""Hybrid Gated DeltaNet model (Qwen3.5 family) speed and checkpoint cost, random weights.

Prints prefill tokens/s, decode tokens/s, the checkpoint size (bytes) and the time to take and
to restore one checkpoint, for a model configured like Qwen3.5-0.8B (default, float32 on CPU)
or like Qwen3.5-9B (``--shape 9b``, bfloat16 on CUDA). Weights' values do not change the work,
so they are random (normal, std 0.02); no file is needed.

Usage: .venv/bin/python bench/hybrid.py [--shape 0.8b|9b] [--device cpu|cuda] [--dtype ...]
       [--prompt 1024] [--decode 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from redlite.engine.torch_engine import TorchEngine  # noqa: E402
from redlite.models.qwen3_5 import Qwen3_5Model  # noqa: E402

COMMON = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
          "hidden_act": "silu", "rms_norm_eps": 1e-6, "full_attention_interval": 4,
          "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
          "linear_num_key_heads": 16, "head_dim": 256, "max_position_embeddings": 262144,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
# Shapes as published for the Qwen3.5 dense models (3 Gated DeltaNet layers per full-attention layer).
SHAPES = {
    "0.8b": {**COMMON, "hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 3584,
             "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_value_heads": 16,
             "tie_word_embeddings": True},
    "9b": {**COMMON, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 12288,
           "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_value_heads": 32,
           "tie_word_embeddings": False},
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, fn, repeat: int = 1) -> tuple[float, object]:
    sync(device)
    started = time.perf_counter()
    for _ in range(repeat):
        result = fn()
    sync(device)
    return (time.perf_counter() - started) / repeat, result


def build(shape: str, device: torch.device, dtype: torch.dtype) -> Qwen3_5Model:
    torch.manual_seed(0)
    model = Qwen3_5Model(SHAPES[shape], device=device, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(0.0, 2.0)
            elif "norm" in name or name.endswith("dt_bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.02)
    return model.eval()


def run(shape: str, device: torch.device, dtype: torch.dtype, prompt: int, decode: int) -> dict:
    model = build(shape, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    engine = TorchEngine(model, model_id=f"qwen3.5-{shape}-random", ctx_size=prompt + decode + 8,
                         device=device, dtype=dtype)
    ids = torch.randint(0, 240000, (prompt,)).tolist()
    engine.prefill(ids[:16])  # warm-up: kernels, allocator
    engine.decode(1)
    engine.reset()
    prefill_s, logits = timed(device, lambda: engine.prefill(ids))
    take_s, checkpoint = timed(device, lambda: engine.take_checkpoint(logits, turn_boundary=True), repeat=5)
    sampler_token = int(torch.argmax(logits))

    def decode_all():
        token = sampler_token
        for _ in range(decode):
            token = int(torch.argmax(engine.decode(token)))
        return token
    decode_s, _ = timed(device, decode_all)
    restore_s, _ = timed(device, lambda: engine.restore_checkpoint(checkpoint), repeat=5)
    assert engine.n_past == prompt
    engine.fingerprint()  # computed once per engine; not part of a checkpoint's cost
    host_s, host = timed(device, lambda: engine.checkpoint_to_tensors(checkpoint))
    return {"shape": shape, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "parameters": params, "prompt_tokens": prompt, "decode_tokens": decode,
            "prefill_tokens_per_s": prompt / prefill_s, "decode_tokens_per_s": decode / decode_s,
            "checkpoint_bytes": checkpoint.nbytes, "take_checkpoint_ms": take_s * 1000,
            "restore_checkpoint_ms": restore_s * 1000, "checkpoint_to_host_ms": host_s * 1000,
            "state_bytes_at_prompt_end": engine.state_nbytes()}


def print_table(rows: list[dict]) -> None:
    print("| model (random weights) | device | dtype | params | prompt | prefill tok/s | decode tok/s "
          "| checkpoint bytes | take ms | restore ms | to host ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| Qwen3.5-{r['shape']} shape | {r['device']} | {r['dtype']} | {r['parameters'] / 1e9:.2f}B "
              f"| {r['prompt_tokens']} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.2f} "
              f"| {r['checkpoint_bytes']:,} | {r['take_checkpoint_ms']:.2f} | {r['restore_checkpoint_ms']:.2f} "
              f"| {r['checkpoint_to_host_ms']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.8b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--json", default=None, help="also write the row as JSON to this path")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    torch.set_grad_enabled(False)
    row = run(args.shape, device, dtype, args.prompt, args.decode)
    row["machine"] = platform.platform()
    print_table([row])
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
