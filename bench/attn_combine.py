"""The decode attention kernel's split combine on a GPU: the last program of a KV head
combining the slices itself against a second launch spread over (head, features) programs,
per model shape, context and split count. Each setting is timed alone (a graph of 8 launches,
median of replays) and its output compared with the in-kernel combine's.

Usage: ``PYTHONPATH=src python3 bench/attn_combine.py [--contexts 1024,8192,32768] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (timed, ceilings)

SHAPES = {  # heads, kv heads, head size, gated (Qwen3.5) or q/k-normed (llama/qwen3)
    "35b-a3b": (16, 2, 256, True), "9b": (16, 4, 256, True), "8b": (32, 8, 128, False), "1b": (32, 8, 64, False)}


def graph_us(fn, device, launches: int = 8) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return gpu.timed(graph.replay, device, 30) / launches * 1e6


def main() -> None:
    from redlite.layers import triton_decode as tk
    from redlite.layers.rotary import RotaryTable

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--out")
    args = parser.parse_args()
    device, dt = torch.device("cuda"), torch.bfloat16
    gpu.ceilings(device, dt, True)
    bw = gpu.R["ceilings"]["copy_bw_Bps"]
    rows = []
    print("| shape | context | splits | combine | µs | KV GB/s | max rel diff |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, (h, kv, d, gated) in SHAPES.items():
        default = tk.default_splits(device, kv, d)
        for ctx in map(int, args.contexts.split(",")):
            r = d // 4 if gated else d
            table = RotaryTable(r, 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r)))
            cos, sin = table.get(0, ctx + 1, device, dt)
            cache = torch.randn(2, kv, ctx + 1, d, device=device, dtype=dt)
            qkv = torch.randn(1, ((2 if gated else 1) * h + 2 * kv) * d, device=device, dtype=dt)
            nw = (1 + 0.1 * torch.randn(d if gated else (h + kv), *(() if gated else (d,)), device=device)).to(dt)
            pos = torch.tensor([ctx], device=device)
            counters = torch.zeros(kv, dtype=torch.int32, device=device)
            ref = None
            for splits in sorted({default, 64, 32, 16}, reverse=True):
                for in_kernel in (True, False):
                    def call():
                        return tk.decode_attention(qkv, pos, cos, sin, nw, 1e-6, cache[0], cache[1], h, kv, d, None,
                                                   splits, counters, gated=gated, k_norm_weight=nw if gated else None,
                                                   combine_in_kernel=in_kernel)
                    out = call().float()
                    ref = out if ref is None else ref
                    diff = float((out - ref).abs().max() / ref.abs().max())
                    us = graph_us(call, device)
                    gbs = 2 * kv * (ctx + 1) * d * 2 / us / 1e3
                    row = dict(shape=name, context=ctx, splits=splits, in_kernel=in_kernel, us=us, kv_GBps=gbs,
                               rel_diff=diff, default_splits=splits == default)
                    rows.append(row)
                    print(f"| {name} | {ctx} | {splits}{'*' if splits == default else ''} | "
                          f"{'in kernel' if in_kernel else 'separate'} | {us:.1f} | {gbs:.0f} | {diff:.1e} |",
                          flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bw_Bps": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
