"""Launch settings of the hybrid family's two non-matrix decode kernels on a GPU: the gated
attention (head_dim 256) and the Gated DeltaNet step, each timed alone on a Qwen3.5 shape
(default 9b; a graph of one launch per layer, median of replays), then the whole decode with
the fastest settings applied. One process, minutes on an H200.

Usage: ``PYTHONPATH=src python3 bench/hybrid_tune.py [--out FILE.json] [--gdn-only] [--shape S
--layers N --contexts 1024,8192 --no-decode]`` (``--layers``: a shallow model of the shape, for
the kernel sweeps alone)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402
from hybrid_report import random_weights  # noqa: E402
from hybrid_report import SHAPES, model_sizes  # noqa: E402

ATTN_CHOICES = [  # (block_n, num_warps, num_stages, splits_per_sm)
    (64, 4, 3, 2), (32, 4, 2, 2), (32, 4, 3, 2), (64, 8, 2, 2), (32, 8, 2, 2), (16, 4, 3, 2),
    (32, 4, 2, 4), (64, 4, 2, 4), (32, 8, 3, 4), (32, 4, 2, 1), (32, 4, 2, 0.5), (64, 4, 2, 1), (16, 4, 3, 1)]
GDN_CHOICES = [(bv, w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)]  # (block_v, num_warps)


def graph_us(fn, layers: int, device) -> float:
    """Median µs per call of ``fn`` from a graph of ``layers`` calls."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    return gpu.timed(graph.replay, device, 30) / layers * 1e6


def tune_attention(model, device, ctx, out):
    from redlite.layers import triton_decode as tk

    layer = next(layer for layer in model.layers if layer.layer_type == "full_attention").self_attn
    h, kv, d = layer.n_heads, layer.n_kv_heads, layer.head_dim
    cos, sin = model.rotary.get(0, ctx + 1, device, torch.bfloat16)
    cache = torch.randn(2, kv, ctx + 1, d, device=device, dtype=torch.bfloat16)
    qkv = torch.randn(1, (2 * h + 2 * kv) * d, device=device, dtype=torch.bfloat16)
    pos = torch.tensor([ctx], device=device)
    counters = torch.zeros(kv, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bytes_read = 2 * kv * (ctx + 1) * d * 2
    for block_n, warps, stages, per_sm in ATTN_CHOICES:
        splits = max(1, min(128, math.ceil(per_sm * sms / kv)))

        def call():
            tk.decode_attention(qkv, pos, cos, sin, layer.q_norm_weight, 1e-6, cache[0], cache[1], h, kv, d, None,
                                splits, counters, block_n=block_n, num_warps=warps, num_stages=stages, gated=True,
                                k_norm_weight=layer.k_norm_weight)
        try:
            us = graph_us(call, 8, device)
        except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit
            print(f"attention {ctx} {(block_n, warps, stages, per_sm)}: failed {type(error).__name__}", flush=True)
            continue
        row = {"kernel": "attention", "context": ctx, "block_n": block_n, "num_warps": warps,
               "num_stages": stages, "splits_per_sm": per_sm, "us": us, "tb_s": bytes_read / us / 1e6}
        out.append(row)
        print(f"attention @ {ctx}: {(block_n, warps, stages, per_sm)} {us:7.1f} us  {row['tb_s']:.2f} TB/s", flush=True)


def tune_gdn(model, device, out, pdl: int = 0, layers: int = 24):
    """The Gated DeltaNet step alone for each (block_v, num_warps) of ``GDN_CHOICES``, a graph
    of one step per layer over ``layers`` distinct states (so none comes from L2); µs and the
    state bytes (read + written) per µs. ``pdl``: launch mode (see triton_gemv)."""
    from redlite.layers import triton_gdn

    mixer = next(layer for layer in model.layers if layer.layer_type == "linear_attention").linear_attn
    convs = [torch.randn(mixer.conv_state_shape(), device=device, dtype=torch.bfloat16) for _ in range(layers)]
    recs = [torch.randn(mixer.recurrent_state_shape(), device=device) * 0.01 for _ in range(layers)]
    proj = torch.randn(1, mixer.in_proj_weight.shape[0], device=device, dtype=torch.bfloat16)
    counters = torch.zeros(triton_gdn.MAX_KEY_HEADS, dtype=torch.int32, device=device)
    state_bytes = 2 * (recs[0].numel() * 4 + convs[0].numel() * 2)
    for block_v, warps in GDN_CHOICES:
        def call():
            for conv, rec in zip(convs, recs):
                triton_gdn.gdn_step(proj, conv, rec, mixer, pdl=pdl, num_warps=warps, block_v=block_v,
                                    counters=counters)
        try:
            us = graph_us(call, 1, device) / layers
        except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit
            print(f"gdn step {(block_v, warps)}: failed {type(error).__name__}", flush=True)
            continue
        out.append({"kernel": "gdn_step", "block_v": block_v, "num_warps": warps, "pdl": pdl, "us": us,
                    "tb_s": state_bytes / us / 1e6})
        print(f"gdn step: block_v {block_v:3d} {warps} warps pdl {pdl} {us:7.2f} us  "
              f"{state_bytes / us / 1e3:6.0f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--gdn-only", action="store_true", help="only the Gated DeltaNet step's sweep")
    parser.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="build only this many layers of the shape (kernel sweeps)")
    parser.add_argument("--contexts", default="8192,32768", help="attention sweep contexts")
    parser.add_argument("--no-decode", action="store_true", help="skip the whole-decode comparison")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.set_grad_enabled(False)
    from redlite.engine.torch_engine import TorchEngine
    from redlite.layers import triton_decode as tk
    from redlite.layers import triton_gdn
    from redlite.layers.triton_gemv import pdl_supported
    from redlite.models.qwen3_5 import Qwen3_5Model

    gpu.ceilings(device, torch.bfloat16, False)
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    model = random_weights(Qwen3_5Model(config, device=device, dtype=torch.bfloat16))
    rows: list[dict] = []
    with torch.inference_mode():
        tune_gdn(model, device, rows)
        if pdl_supported(device):
            tune_gdn(model, device, rows, pdl=1)
        if args.gdn_only:
            if args.out:
                Path(args.out).write_text(json.dumps({"rows": rows, "ceilings": gpu.R["ceilings"]}, indent=1))
            return
        for ctx in (int(c) for c in args.contexts.split(",")):
            tune_attention(model, device, ctx, rows)
    attn = [r for r in rows if r["kernel"] == "attention"]
    best_attn = min({(r["block_n"], r["num_warps"], r["num_stages"], r["splits_per_sm"]) for r in attn},
                    key=lambda c: sum(r["us"] for r in attn if (r["block_n"], r["num_warps"], r["num_stages"],
                                                               r["splits_per_sm"]) == c))
    best = min((r for r in rows if r["kernel"] == "gdn_step" and not r["pdl"]), key=lambda r: r["us"])
    best_gdn = (best["block_v"], best["num_warps"])
    print(f"best attention settings (sum over contexts): {best_attn}; best gdn (block_v, warps): {best_gdn}",
          flush=True)
    if args.no_decode:
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows, "best_attention": best_attn, "best_gdn": best_gdn,
                                                  "ceilings": gpu.R["ceilings"]}, indent=1))
        return
    decode = {}
    for label, attn_cfg, gdn in (("default", None, (triton_gdn.GDN_BLOCK_V, triton_gdn.GDN_WARPS)),
                                 ("best", best_attn, best_gdn)):
        if attn_cfg:
            tk.ATTN_CONFIGS_BY_DIM[256] = dict(zip(("block_n", "num_warps", "num_stages", "splits_per_sm"),
                                                   attn_cfg))
        triton_gdn.GDN_BLOCK_V, triton_gdn.GDN_WARPS = gdn
        engine = TorchEngine(model, ctx_size=32768 + 1024, device=device, dtype=torch.bfloat16)
        gpu.R["decode"] = []
        gpu.decode_speed(engine, model_sizes(model), [1024, 8192, 32768], 128, device)
        decode[label] = gpu.R["decode"]
        del engine
    result = {"rows": rows, "best_attention": best_attn, "best_gdn": best_gdn, "decode": decode,
              "ceilings": gpu.R["ceilings"]}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
