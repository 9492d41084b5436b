"""Milliseconds per decode token of the bundled model at several depths, in the engine (no server).

    PYTHONPATH=src python bench/decode_depth.py [--kv-dtype float32] [--depths 7000,4000,2000,100]
                                                [--tokens 16] [--reps 5]

Prefills the deepest depth once (random ids), then for each depth (deepest first) rewinds to it
and times ``--tokens`` greedy decode tokens, ``--reps`` times; prints the median per depth. The
growth from depth to depth is what the attention over the cache costs. For an A/B of two source
trees, run it with ``PYTHONPATH=`` each tree in turn (``--kv-dtype old``: a tree without the
option), alternating, in one sitting.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from redlite.engine.torch_engine import TorchEngine
from redlite.loading.bundled import bundled_model_path
from redlite.loading.gguf import resolve_model_dir
from redlite.loading.hf import load_hf_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-dtype", default="float32", help="float32, float16, or old (no option)")
    parser.add_argument("--depths", default="7000,4000,2000,100")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    depths = sorted((int(d) for d in args.depths.split(",")), reverse=True)
    kernels = {}
    if args.kv_dtype != "old":
        from redlite.engine.kernel_options import KernelOptions
        kernels["kernels"] = KernelOptions(kv_dtype=args.kv_dtype)
    model, _ = load_hf_model(resolve_model_dir(bundled_model_path()), "cpu", torch.float32)
    engine = TorchEngine(model, ctx_size=depths[0] + args.tokens + 1, device="cpu", **kernels)
    engine.prefill(torch.randint(100, 40000, (depths[0],), generator=torch.Generator().manual_seed(0)).tolist())
    figures = []
    for depth in depths:
        times = []
        for _ in range(args.reps):
            engine.rewind(depth)
            started, token = time.perf_counter(), 5
            for _ in range(args.tokens):
                token = int(engine.decode(token).argmax())
            times.append((time.perf_counter() - started) / args.tokens * 1000)
        figures.append(f"{depth}: {statistics.median(times):.1f} ms")
    print(f"kv {args.kv_dtype}: " + ", ".join(figures), flush=True)


if __name__ == "__main__":
    main()
