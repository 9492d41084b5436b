"""Helpers of bench/hybrid.py for the mixture-of-experts shape (35b-a3b): redlite's model
sharing transformers' expert tensors (two 70 GB copies do not fit one H200), and
transformers' own prefill timed beside redlite's."""

from __future__ import annotations

import time

import torch
from torch import nn

from gpu_hf import say, sync

#: Factor on the random router weights (see :func:`build_sharing_experts`).
ROUTER_SPREAD = 8.0


def build_sharing_experts(config: dict, hf, device: torch.device, dtype: torch.dtype):
    """A ``Qwen3_5Model`` of ``config`` whose routed-expert weights are ``hf``'s own tensors
    (``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], the layout both
    keep), every other weight allocated on ``device`` and copied from ``hf``. The values are
    the same as a plain ``load_hf_weights``; only the expert memory is not doubled.

    ``hf``'s router weights are first scaled by ``ROUTER_SPREAD`` in place (both engines use
    the scaled ones): transformers' random initialisation leaves the top-k of the router
    nearly tied, so bf16 rounding differences between paths would swap experts and the
    checks would compare different expert choices."""
    from redlite.models.qwen3_5 import Qwen3_5Model

    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.mul_(ROUTER_SPREAD)

    model = Qwen3_5Model(config, device="meta", dtype=dtype)
    hf_params = dict(hf.named_parameters())
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}.mlp.experts."
        layer.mlp.gate_up_weight = nn.Parameter(hf_params[prefix + "gate_up_proj"], requires_grad=False)
        layer.mlp.down_weight = nn.Parameter(hf_params[prefix + "down_proj"], requires_grad=False)
    made: dict[int, nn.Parameter] = {}  # a parameter held under two names (tied) stays one
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=p.dtype), requires_grad=False)
                module._parameters[name] = made[id(p)]
    if model.tied:
        model.lm_head_weight = model.embed_weight
    model.load_hf_weights(hf.state_dict())  # the shared experts copy onto themselves: a no-op
    return model.eval()


def hf_prefill_speed(R: dict, hf, engine, lengths, device, reps: int = 2) -> None:
    """transformers' forward over a ``length``-token prompt (no cache, last logits only),
    best of ``reps``, as rows ``engine: transformers`` of ``R["prefill"]`` beside redlite's."""
    gen = torch.Generator().manual_seed(5)
    for length in lengths:
        ids = torch.randint(0, engine.vocab_size, (1, length), generator=gen).to(device)
        best = float("inf")
        with torch.inference_mode():
            hf(ids[:, :512], use_cache=False, logits_to_keep=1)  # warm-up (kernel compilation)
            for _ in range(reps):
                sync(device)
                t0 = time.perf_counter()
                hf(ids, use_cache=False, logits_to_keep=1)
                sync(device)
                best = min(best, time.perf_counter() - t0)
        ours = next((r for r in R["prefill"] if r["tokens"] == length and r.get("engine", "redlite") == "redlite"),
                    None)
        row = {"engine": "transformers", "tokens": length, "seconds": best, "tok_s": length / best,
               "flops": ours["flops"] if ours else None}
        row["tflops"] = row["flops"] / best / 1e12 if row["flops"] else None
        peak = R["ceilings"].get("matmul_flops")
        row["pct_of_matmul_peak"] = 100 * row["flops"] / best / peak if row["flops"] and peak else None
        row["fla"] = ours["fla"] if ours else None
        R["prefill"].append(row)
        if ours:
            R.setdefault("prefill_vs_transformers", {})[str(length)] = ours["tok_s"] / row["tok_s"]
        say(f"transformers prefill {length:>6}: {row['tok_s']:10.0f} tok/s  {best * 1e3:9.1f} ms"
            + (f"  (redlite {ours['tok_s'] / row['tok_s']:.2f}x)" if ours else ""))


def moe_step_tune(R: dict, model, device: torch.device, n_layers: int = 8) -> None:
    """bench/moe_tune.py's sweep over the model's first ``n_layers`` MoE blocks (distinct
    weights, random inputs); the fastest settings become the defaults before any graph is
    captured. Rows into ``R["moe_tune"]``."""
    import moe_tune

    hidden = model.embed_weight.shape[1]
    layers = [(layer.mlp, torch.randn(1, hidden, device=device, dtype=model.embed_weight.dtype),
               layer.post_attention_layernorm.weight) for layer in model.layers[:n_layers] if layer.moe]
    R["moe_tune"] = moe_tune.sweep(layers, device, R["ceilings"].get("copy_bw_Bps"), say, apply=True)
