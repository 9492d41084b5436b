"""Launch settings of the batched decode attention (:mod:`redlite.layers.triton_batch_attention`)
on a GPU: per batch size and context, each key-slice count and (block_n, warps, stages) timed
inside a CUDA graph (bench/gpu_tune.py's ``per_call_s``: median of replays, caches rotated so
L2 holds none of them), with the KV bytes read per second. Qwen3-8B attention shape (32 heads,
8 KV heads, head_dim 128), bfloat16. Marks the setting the code uses now (``*``).

Usage: ``PYTHONPATH=src python3 bench/batch_attention_tune.py [--batches 8,32] [--contexts 256,1024,4096]``
"""

from __future__ import annotations

import argparse

import torch

from gpu_tune import copy_bw, per_call_s
from redlite.layers import triton_batch_attention as tba
from redlite.layers import triton_decode as td
from redlite.layers.kv_cache import KVCache

DEV, DT = torch.device("cuda"), torch.bfloat16
HEADS, KV, DIM = 32, 8, 128
CONFIGS = [(64, 4, 3), (32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 8, 2), (32, 2, 2)]


def sweep(batch: int, ctx: int, bw: float, copies: int) -> None:
    sets = []
    for _ in range(copies):
        caches = [KVCache(1, KV, DIM, ctx + 64, DEV, DT) for _ in range(batch)]
        for cache in caches:
            cache.data.normal_()
        sets.append((caches, tba.cache_bases(caches, DEV)))
    qkv = torch.randn(batch, (HEADS + 2 * KV) * DIM, device=DEV, dtype=DT)
    cos = torch.randn(ctx + 64, 1, DIM, device=DEV, dtype=DT)
    nw = torch.ones(HEADS + KV, DIM, device=DEV, dtype=DT)
    pos = torch.full((batch,), ctx - 1, device=DEV, dtype=torch.long)
    nbytes = batch * 2 * KV * ctx * DIM * 2
    now = tba.batch_splits(DEV, KV, batch, DIM)
    base = td.attn_config(DIM)
    for splits in sorted({1, 2, 4, 8, 16, now}):
        for block_n, warps, stages in CONFIGS:
            config = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
            try:
                fns = [lambda c=c, b=b: tba.batch_decode_attention(qkv, pos, cos, cos, nw, 1e-6, b, c[0], 0, HEADS, KV,
                                                                   DIM, None, splits, config=config)
                       for c, b in sets]
                seconds = per_call_s(fns)
            except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit
                print(f"B {batch} ctx {ctx} splits {splits} {config}: failed {type(error).__name__}", flush=True)
                continue
            mark = "*" if splits == now and all(base[k] == v for k, v in config.items()) else " "
            print(f"{mark} B {batch:>3} ctx {ctx:>5} splits {splits:>3} block_n {block_n:>3} warps {warps} "
                  f"stages {stages}: {seconds * 1e6:8.1f} us  {nbytes / seconds / 1e12:5.2f} TB/s "
                  f"({100 * nbytes / seconds / bw:5.1f}% of copy)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--contexts", default="256,1024,4096")
    args = parser.parse_args()
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    for batch in [int(b) for b in args.batches.split(",")]:
        for ctx in [int(c) for c in args.contexts.split(",")]:
            per_set = batch * 2 * KV * (ctx + 64) * DIM * 2
            sweep(batch, ctx, bw, copies=max(2, min(8, (256 << 20) // per_set)))


if __name__ == "__main__":
    main()
