"""Micro-timings of the decode step's parts on a GPU, to pick the attention kernel's launch
settings (``redlite.layers.triton_decode.ATTN_CONFIG``) and see where decode time goes.

Usage: ``PYTHONPATH=src python3 bench/gpu_tune.py [--quick]``. Every figure is the time of one
call inside a CUDA graph of many calls (median of replays), with inputs rotated so that no
call reads data another left in the 60 MB L2. Shapes: Qwen3-8B (32 heads, 8 KV heads,
head_dim 128, hidden 4096, intermediate 12288, vocab 151936), bfloat16.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from redlite.layers import triton_decode as tk

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
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(fns))
    return statistics.median(times)


def copy_bw() -> float:
    src = torch.empty(1 << 30, device=DEV, dtype=DT).normal_()
    dst = torch.empty_like(src)
    seconds = per_call_s([lambda: dst.copy_(src)] * 4)
    return 2 * src.numel() * 2 / seconds


def attention(ctx: int, configs, n_copies: int, bw: float) -> None:
    heads, kv, dim = 32, 8, 128
    caches = [torch.randn(2, kv, ctx + 64, dim, device=DEV, dtype=DT) for _ in range(n_copies)]
    q = torch.randn(heads, dim, device=DEV, dtype=DT)
    pos = torch.tensor([ctx - 1], device=DEV)
    nbytes = 2 * kv * ctx * dim * 2
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for block_n, warps, stages, mult in configs:
        splits = max(1, min(128, round(mult * sms / kv)))
        try:
            fns = [lambda c=c: tk.decode_attention(q, c[0], c[1], pos, None, splits, block_n, warps, stages)
                   for c in caches]
            seconds = per_call_s(fns)
        except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit
            print(f"attention ctx {ctx} block_n {block_n} warps {warps} stages {stages} splits {splits}: "
                  f"failed {type(error).__name__}: {str(error)[:100]}", flush=True)
            continue
        print(f"attention ctx {ctx:>6} block_n {block_n:>3} warps {warps} stages {stages} splits {splits:>3}: "
              f"{seconds * 1e6:8.1f} us  {nbytes / seconds / 1e12:5.2f} TB/s  "
              f"({100 * nbytes / seconds / bw:5.1f}% of copy bw)", flush=True)


def gemv(bw: float) -> None:
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
              "lm_head": (151936, 4096)}
    for name, (n, k) in shapes.items():
        copies = max(2, int(6e8 // (n * k * 2)))
        weights = [torch.randn(n, k, device=DEV, dtype=DT) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=DEV, dtype=DT)
        seconds = per_call_s([lambda w=w: F.linear(x, w) for w in weights])
        nbytes = n * k * 2
        print(f"linear {name:>8} [1,{k}]x[{n},{k}]^T: {seconds * 1e6:7.1f} us  {nbytes / seconds / 1e12:5.2f} TB/s "
              f"({100 * nbytes / seconds / bw:5.1f}% of copy bw)", flush=True)
        del weights


def small_kernels() -> None:
    x = torch.randn(1, 4096, device=DEV, dtype=DT)
    d = torch.randn(1, 4096, device=DEV, dtype=DT)
    w = torch.randn(4096, device=DEV, dtype=DT)
    qkv = torch.randn(1, 48 * 128, device=DEV, dtype=DT)
    cos = torch.randn(1024, 1, 128, device=DEV, dtype=DT)
    nw = torch.randn(40, 128, device=DEV, dtype=DT)
    cache = torch.randn(2, 8, 1024, 128, device=DEV, dtype=DT)
    pos = torch.tensor([100], device=DEV)
    gu = torch.randn(1, 24576, device=DEV, dtype=DT)
    cases = {
        "add_rms_norm": lambda: tk.add_rms_norm(x, d, w, 1e-6),
        "qk_rope_store": lambda: tk.qk_rope_store(qkv, pos, cos, cos, nw, 1e-6, cache[0], cache[1], 32, 8, 128),
        "silu_mul": lambda: tk.silu_mul(gu, 12288),
        "attention @101": lambda: tk.decode_attention(qkv[:, :4096].view(32, 128), cache[0], cache[1], pos, None, 33),
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
    args = parser.parse_args()
    torch.manual_seed(0)
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    with torch.inference_mode():
        sdpa_new_shapes()
        if not args.quick:
            small_kernels()
            gemv(bw)
        if args.quick:
            configs = [(64, 4, 3, 4), (64, 4, 2, 2), (64, 4, 3, 2), (64, 4, 4, 4), (128, 4, 3, 4), (64, 8, 3, 4)]
        else:
            configs = [(b, w, s, m) for b in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3) for m in (2, 4)]
        attention(32768, configs, 4, bw)
        attention(8192, configs[:1], 8, bw)
        attention(1024, configs[:1], 8, bw)


if __name__ == "__main__":
    main()
