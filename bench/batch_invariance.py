"""Batch-invariant decode products (:mod:`redlite.layers.triton_gemv_rows`) against cuBLAS, on
the 8B shape's weights: per batch size M, the time of one decode step's products (36 layers of
q/k/v, o, gate/up and down, plus the lm_head) and whether every row equals its one-token
product bitwise.

Usage (CUDA)::

    PYTHONPATH=src python3 bench/batch_invariance.py [--batches 1,2,4,8,16,32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from redlite.layers import triton_gemv as tg

HIDDEN, INTER, QKV, LAYERS, VOCAB = 4096, 12288, 6144, 36, 151936


def products(device):
    g = torch.Generator(device=device).manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    return {"qkv": w(QKV, HIDDEN), "o": w(HIDDEN, HIDDEN), "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER), "lm_head": w(VOCAB, HIDDEN)}


def step_fns(W, m, device, invariant: bool):
    g = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, HIDDEN, generator=g, device=device).to(torch.bfloat16)
    xi = torch.randn(m, INTER, generator=g, device=device).to(torch.bfloat16)
    nw = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    res = x.clone()
    if invariant:
        calls = [lambda: tg.gemv(x, W["qkv"], norm_weight=nw, eps=1e-6),
                 lambda: tg.gemv(x, W["o"], residual=res),
                 lambda: tg.gemv(x, W["gate_up"], norm_weight=nw, eps=1e-6, gated=True),
                 lambda: tg.gemv(xi, W["down"], residual=res)]
        head = lambda: tg.gemv(x, W["lm_head"], norm_weight=nw, eps=1e-6, out_float32=True)  # noqa: E731
    else:
        calls = [lambda: F.linear(x, W["qkv"]), lambda: res.add_(F.linear(x, W["o"])),
                 lambda: F.linear(x, W["gate_up"]), lambda: res.add_(F.linear(xi, W["down"]))]
        head = lambda: F.linear(x, W["lm_head"]).float()  # noqa: E731

    def step():
        for _ in range(LAYERS):
            for call in calls:
                call()
        head()
    return step


def time_ms(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bitwise(W, device) -> dict:
    """Each mode and shape: do the rows of an M-row product equal the one-row products?"""
    out = {}
    g = torch.Generator(device=device).manual_seed(7)
    odd = (torch.randn(3000, 1000, generator=g, device=device) * 0.02).to(torch.bfloat16)
    bias = (torch.randn(3000, generator=g, device=device) * 0.02).to(torch.bfloat16)
    for m in (2, 3, 5, 8, 13, 32):
        for name, weight, kw in (("qkv+norm", W["qkv"], dict(norm=True)), ("o+residual", W["o"], dict(res=True)),
                                 ("gate_up+norm", W["gate_up"], dict(norm=True, gated=True)),
                                 ("down+residual", W["down"], dict(res=True)),
                                 ("lm_head+norm f32", W["lm_head"], dict(norm=True, f32=True)),
                                 ("odd+bias zc-norm", odd, dict(norm=True, zc=True, bias=True))):
            k = weight.shape[1]
            x = (torch.randn(m, k, generator=g, device=device) * 3).to(torch.bfloat16)
            nw = (1 + 0.1 * torch.randn(k, generator=g, device=device)).to(torch.bfloat16)

            def run(rows):
                args = dict(norm_weight=nw if kw.get("norm") else None, eps=1e-6, gated=kw.get("gated", False),
                            out_float32=kw.get("f32", False), zero_centered=kw.get("zc", False))
                b = bias if kw.get("bias") else None
                if kw.get("res"):
                    r = torch.ones(rows.shape[0], weight.shape[0], device=device, dtype=torch.bfloat16)
                    return tg.gemv(rows, weight, b, residual=r, **args)
                return tg.gemv(rows, weight, b, **args)
            together = run(x)
            alone = torch.cat([run(x[i:i + 1].contiguous()) for i in range(m)])
            same = torch.equal(together, alone)
            err = (together.float() - alone.float()).abs().max().item()
            out[f"{name} M={m}"] = {"bitwise": same, "max_abs_diff": err}
            if not same:
                print(f"NOT bitwise: {name} M={m}: max |diff| {err:.3g}", flush=True)
    print(f"bitwise equal: {sum(v['bitwise'] for v in out.values())} of {len(out)} cases", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    W = products(device)
    result = {"device": torch.cuda.get_device_name(), "bitwise": bitwise(W, device), "step_ms": {}}
    print("| M | cuBLAS products ms | invariant products ms | ratio |\n|---|---|---|---|")
    for m in (int(b) for b in args.batches.split(",")):
        cublas, inv = time_ms(step_fns(W, m, device, False)), time_ms(step_fns(W, m, device, True))
        result["step_ms"][m] = {"cublas": cublas, "invariant": inv}
        print(f"| {m} | {cublas:.2f} | {inv:.2f} | {inv / cublas:.2f}x |", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "batch_invariance.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
