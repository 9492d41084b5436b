"""Micro-timings of the decode step's parts on a GPU, to pick the attention kernel's launch
settings (``redlite.layers.triton_decode.ATTN_CONFIG``) and see where decode time goes.

Usage: ``PYTHONPATH=src python3 bench/gpu_tune.py [--quick] [--gemv]`` (``--gemv``: only the
sweep of the fused matrix-vector kernel's launch settings, per shape and form, against cuBLAS,
and a chain of one decoder layer's four products with and without programmatic dependent
launch; it prints ``GEMV_CONFIGS`` for :mod:`redlite.layers.triton_gemv`). Every figure is the time of one
call inside a CUDA graph of many calls (median of replays), with inputs rotated so that no
call reads data another left in the 60 MB L2. Shapes: Qwen3-8B (32 heads, 8 KV heads,
head_dim 128, hidden 4096, intermediate 12288, vocab 151936), bfloat16.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from redlite.layers import triton_decode as tk
from redlite.layers import triton_gemv as tg

DEV, DT = torch.device("cuda"), torch.bfloat16


def per_call_s(fns, reps: int = 5) -> float:
    """Median seconds per call of the callables ``fns`` replayed in one CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return replay_ms(graph, reps) / 1e3 / len(fns)


def replay_ms(graph, reps: int) -> float:
    """Median ms of one replay of the CUDA graph ``graph`` (CUDA events), over ``reps``."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bw() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), timed with events
    outside a graph (a graph turns a copy into a copy-engine node, which is slower)."""
    src = torch.empty(1 << 30, device=DEV, dtype=DT).normal_()
    dst = torch.empty_like(src)
    for _ in range(300):  # ~1 s of copies first: the clocks ramp up from idle
        dst.copy_(src)
    times = []
    for _ in range(9):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 2 / statistics.median(times)


def attention(ctx: int, configs, n_copies: int, bw: float) -> None:
    heads, kv, dim = 32, 8, 128
    caches = [torch.randn(2, kv, ctx + 64, dim, device=DEV, dtype=DT) for _ in range(n_copies)]
    qkv = torch.randn(1, (heads + 2 * kv) * dim, device=DEV, dtype=DT)
    cos = torch.randn(ctx + 64, 1, dim, device=DEV, dtype=DT)
    nw = torch.ones(heads + kv, dim, device=DEV, dtype=DT)
    counters = torch.zeros(kv, dtype=torch.int32, device=DEV)
    pos = torch.tensor([ctx - 1], device=DEV)
    nbytes = 2 * kv * ctx * dim * 2
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for block_n, warps, stages, mult in configs:
        splits = max(1, min(128, round(mult * sms / kv)))
        try:
            fns = [lambda c=c: tk.decode_attention(qkv, pos, cos, cos, nw, 1e-6, c[0], c[1], heads, kv, dim, None,
                                                   splits, counters, block_n, warps, stages) for c in caches]
            seconds = per_call_s(fns)
        except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit
            print(f"attention ctx {ctx} block_n {block_n} warps {warps} stages {stages} splits {splits}: "
                  f"failed {type(error).__name__}: {str(error)[:100]}", flush=True)
            continue
        print(f"attention ctx {ctx:>6} block_n {block_n:>3} warps {warps} stages {stages} splits {splits:>3}: "
              f"{seconds * 1e6:8.1f} us  {nbytes / seconds / 1e12:5.2f} TB/s  "
              f"({100 * nbytes / seconds / bw:5.1f}% of copy bw)", flush=True)


GEMV_SHAPES = {  # name: (mode, rows, k, norm) for Qwen3-8B
    "qkv": (tg.PLAIN, 6144, 4096, True), "o": (tg.RESIDUAL, 4096, 4096, False),
    "gate_up": (tg.GATED, 12288, 4096, True), "down": (tg.RESIDUAL, 4096, 12288, False),
    "lm_head": (tg.PLAIN, 151936, 4096, True)}
GEMV_CANDIDATES = [(2, 4096, 2, 1, 0), (2, 4096, 4, 1, 0), (2, 4096, 8, 1, 0), (4, 4096, 4, 1, 0),
                   (4, 2048, 4, 1, 0), (2, 4096, 4, 1, 2), (2, 4096, 4, 1, 4), (2, 4096, 4, 1, 8),
                   (1, 4096, 4, 1, 4), (1, 4096, 4, 1, 8), (4, 2048, 4, 1, 4), (4, 2048, 4, 1, 8),
                   (2, 4096, 8, 1, 2), (2, 4096, 8, 1, 4), (4, 4096, 8, 1, 2), (4, 4096, 8, 1, 4),
                   (2, 2048, 4, 1, 8), (8, 1024, 4, 1, 4), (1, 8192, 8, 1, 4)]


def gemv_call(mode, rows, k, norm, weight, x, nw, res, config, pdl=False):
    if mode == tg.RESIDUAL:
        return lambda: tg.gemv(x, weight, residual=res, config=config, pdl=pdl)
    return lambda: tg.gemv(x, weight, norm_weight=nw if norm else None, eps=1e-6, gated=mode == tg.GATED,
                           out_float32=rows > 100000, config=config, pdl=pdl)


def gemv_sweep(bw: float, save: str | None = None) -> dict:
    """Best launch settings per shape (each timed over weights rotated past the L2), against
    cuBLAS doing the same product (plus the separate norm / silu kernel where it needs one)."""
    best = {}
    for name, (mode, rows, k, norm) in GEMV_SHAPES.items():
        n_w = 2 * rows if mode == tg.GATED else rows
        nbytes = n_w * k * 2
        copies = max(2, int(8e8 // nbytes))
        weights = [torch.randn(n_w, k, device=DEV, dtype=DT) * 0.02 for _ in range(copies)]
        x, nw = torch.randn(1, k, device=DEV, dtype=DT), torch.ones(k, device=DEV, dtype=DT)
        res = torch.zeros(1, rows, device=DEV, dtype=DT)
        cublas = per_call_s([lambda w=w: F.linear(x, w) for w in weights])
        print(f"gemv {name:>8} [{n_w}x{k}] cuBLAS F.linear: {cublas * 1e6:7.1f} us "
              f"{100 * nbytes / cublas / bw:5.1f}% of copy bw", flush=True)
        results = []
        for config in GEMV_CANDIDATES:
            if config[1] > k:
                continue
            try:
                seconds = per_call_s([gemv_call(mode, rows, k, norm, w, x, nw, res, config) for w in weights])
            except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit
                print(f"gemv {name:>8} {config}: failed {type(error).__name__}: {str(error)[:80]}", flush=True)
                continue
            results.append((seconds, config))
            print(f"gemv {name:>8} {config}: {seconds * 1e6:7.1f} us {100 * nbytes / seconds / bw:5.1f}% of copy bw",
                  flush=True)
        seconds, config = min(results)
        best[(mode, rows, k)] = config
        print(f"gemv {name:>8} best {config}: {seconds * 1e6:.1f} us ({100 * nbytes / seconds / bw:.1f}% of copy "
              f"bw; cuBLAS {100 * nbytes / cublas / bw:.1f}%)", flush=True)
        del weights
    print("GEMV_CONFIGS = {" + ", ".join(f"{key}: {value}" for key, value in best.items()) + "}", flush=True)
    if save:
        Path(save).write_text(json.dumps({",".join(map(str, key)): value for key, value in best.items()}))
        print(f"saved to {save} (use with redlite serve --gemv-configs {save})", flush=True)
    return best


def layer_chain(bw: float, best: dict, n_layers: int = 8) -> None:
    """One decoder layer's four products (norm+qkv, o+residual, norm+gate/up+silu, down+residual)
    over ``n_layers`` weight sets in one graph: Triton with and without PDL, and cuBLAS with
    torch's norm/add/silu ops."""
    shapes = {name: GEMV_SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}
    layers = [{name: torch.randn(2 * r if m == tg.GATED else r, k, device=DEV, dtype=DT) * 0.02
               for name, (m, r, k, _) in shapes.items()} for _ in range(n_layers)]
    nbytes = sum(w.numel() * 2 for w in layers[0].values())
    h = torch.randn(1, 4096, device=DEV, dtype=DT)
    nw = torch.ones(4096, device=DEV, dtype=DT)
    attn = torch.randn(1, 4096, device=DEV, dtype=DT)

    def triton_layer(ws, pdl):
        def run():
            tg.gemv(h, ws["qkv"], norm_weight=nw, eps=1e-6, pdl=pdl, config=best.get((0, 6144, 4096)))
            tg.gemv(attn, ws["o"], residual=h, pdl=pdl, config=best.get((1, 4096, 4096)))
            act = tg.gemv(h, ws["gate_up"], norm_weight=nw, eps=1e-6, gated=True, pdl=pdl,
                          config=best.get((2, 12288, 4096)))
            tg.gemv(act, ws["down"], residual=h, pdl=pdl, config=best.get((1, 4096, 12288)))
        return run

    def cublas_layer(ws):
        def run():
            F.linear(tk.add_rms_norm(h, None, nw, 1e-6), ws["qkv"])
            g = F.linear(tk.add_rms_norm(h, F.linear(attn, ws["o"]), nw, 1e-6), ws["gate_up"])
            h.add_(F.linear(tk.silu_mul(g, 12288), ws["down"]))
        return run

    variants = {"triton": [triton_layer(ws, 0) for ws in layers],
                "cublas + triton norms": [cublas_layer(ws) for ws in layers]}
    if tg.pdl_supported(DEV):
        variants["triton + pdl 1"] = [triton_layer(ws, 1) for ws in layers]
        variants["triton + pdl 2"] = [triton_layer(ws, 2) for ws in layers]
    for label, fns in variants.items():
        seconds = per_call_s(fns)
        print(f"layer chain {label:>22}: {seconds * 1e6:7.1f} us per layer  "
              f"{100 * nbytes / seconds / bw:5.1f}% of copy bw ({nbytes / 1e6:.0f} MB)", flush=True)


def small_kernels() -> None:
    x = torch.randn(1, 4096, device=DEV, dtype=DT)
    d = torch.randn(1, 4096, device=DEV, dtype=DT)
    w = torch.randn(4096, device=DEV, dtype=DT)
    qkv = torch.randn(1, 48 * 128, device=DEV, dtype=DT)
    cos = torch.randn(1024, 1, 128, device=DEV, dtype=DT)
    nw = torch.randn(40, 128, device=DEV, dtype=DT)
    counters = torch.zeros(8, dtype=torch.int32, device=DEV)
    cache = torch.randn(2, 8, 1024, 128, device=DEV, dtype=DT)
    pos = torch.tensor([100], device=DEV)
    gu = torch.randn(1, 24576, device=DEV, dtype=DT)
    cases = {
        "add_rms_norm": lambda: tk.add_rms_norm(x, d, w, 1e-6),
        "silu_mul": lambda: tk.silu_mul(gu, 12288),
        "attention @101": lambda: tk.decode_attention(qkv, pos, cos, cos, nw, 1e-6, cache[0], cache[1], 32, 8, 128,
                                                      None, 33, counters),
        "torch add_": lambda: x.add_(d),
    }
    for name, fn in cases.items():
        print(f"small kernel {name:>15}: {per_call_s([fn] * 50) * 1e6:6.2f} us per call", flush=True)


def sdpa_new_shapes() -> None:
    """Seconds per SDPA call when every call has a new key length (as eager decode and
    prefills of new prompt lengths do), with the default dispatch and with flash / efficient
    / math only (what redlite.layers.attention uses on CUDA)."""
    import contextlib
    import time

    from torch.nn.attention import SDPBackend, sdpa_kernel

    restricted = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    k = torch.randn(1, 8, 8192, 128, device=DEV, dtype=DT)
    for label, ctx in (("default", contextlib.nullcontext), ("flash/eff/math", lambda: sdpa_kernel(restricted))):
        for kind, start in (("decode q[1,8,4,128]", 1000), ("prefill q[1,32,L,128] causal", 500)):
            times = []
            for length in range(start, start + 12):
                q = torch.randn(1, 8, 4, 128, device=DEV, dtype=DT) if kind.startswith("decode") else \
                    torch.randn(1, 32, length, 128, device=DEV, dtype=DT)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with ctx():
                    F.scaled_dot_product_attention(q, k[:, :, :length], k[:, :, :length],
                                                   is_causal=not kind.startswith("decode"), enable_gqa=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            print(f"sdpa {label:>15} {kind:>30}, new length each call: median {statistics.median(times[2:]) * 1e3:7.3f} ms "
                  f"(first {times[0] * 1e3:.1f} ms)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer attention settings")
    parser.add_argument("--gemv", action="store_true", help="only the matrix-vector sweep and layer chain")
    parser.add_argument("--save", help="with --gemv: write the best settings to this JSON file")
    args = parser.parse_args()
    torch.manual_seed(0)
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    if args.gemv:
        with torch.inference_mode():
            layer_chain(bw, gemv_sweep(bw, args.save))
        return
    with torch.inference_mode():
        sdpa_new_shapes()
        if not args.quick:
            small_kernels()
            gemv_sweep(bw)
        if args.quick:
            configs = [(64, 4, 3, 4), (64, 4, 2, 2), (64, 4, 3, 2), (64, 4, 4, 4), (128, 4, 3, 4), (64, 8, 3, 4)]
        else:
            configs = [(b, w, s, m) for b in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3) for m in (2, 4)]
        attention(32768, configs, 4, bw)
        attention(8192, configs[:1], 8, bw)
        attention(1024, configs[:1], 8, bw)


if __name__ == "__main__":
    main()
