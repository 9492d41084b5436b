"""Launch settings of the fused mixture-of-experts decode step (redlite.layers.triton_moe) on a
GPU: the Qwen3.5-35B-A3B block (256 experts, 8 per token, widths 512, hidden 2048) timed as a
graph of one step per layer over distinct layers (so no weight comes from L2), for each pair
of (block_n, num_warps) settings of the gate/up and the down kernel, against the bytes the
step reads (router, shared expert, the 8 chosen experts). One process, about a minute.

Usage: ``PYTHONPATH=src python3 bench/moe_tune.py [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402
from hybrid_report import SHAPES  # noqa: E402

GATE_UP = [(2, 4), (4, 4), (4, 8), (8, 8)]
DOWN = [(2, 4), (4, 4), (8, 4), (8, 8), (16, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from redlite.layers import triton_moe
    from redlite.layers.decode_ops import TorchDecodeOps
    from redlite.layers.moe import SparseMoE

    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg = SHAPES["35b-a3b"]
    h, e, k = cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"]
    inter, shared = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        moe = SparseMoE(h, e, k, inter, shared, True, device=device, dtype=dtype)
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
        layers.append((moe, torch.randn(1, h, device=device, dtype=dtype), torch.randn(h, device=device, dtype=dtype)))
    esize = 2
    read = esize * (h * (e + 1) + 3 * h * shared + k * 3 * h * inter)
    gpu.ceilings(device, dtype, True)
    bw = gpu.R["ceilings"].get("copy_bw_Bps")
    rows = []

    def measure(label, step):
        for moe, x, nw in layers:
            step(moe, x, nw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for moe, x, nw in layers:
                step(moe, x, nw)
        us = gpu.timed(graph.replay, device, 30) / len(layers) * 1e6
        row = {"variant": label, "us_per_layer": us, "GBps": read / us / 1e3,
               "pct_of_copy_bw": 100 * read / (us * 1e-6) / bw if bw else None}
        rows.append(row)
        print(f"{label:>40}: {us:7.2f} us/layer  {row['GBps']:7.0f} GB/s  "
              f"{row['pct_of_copy_bw'] or float('nan'):5.1f}% of copy bandwidth", flush=True)

    with torch.inference_mode():
        ref = TorchDecodeOps()
        measure("torch gathered (reference)", lambda m, x, nw: ref.moe(x, nw, 1e-6, m))
        for pdl, (gu, down) in itertools.product((0, 1), itertools.product(GATE_UP, DOWN)):
            if pdl and (gu, down) != (triton_moe.GATE_UP_CONFIG, triton_moe.DOWN_CONFIG):
                continue
            try:
                measure(f"triton gate/up {gu} down {down} pdl {pdl}",
                        lambda m, x, nw: triton_moe.moe_step(x, nw, 1e-6, m, pdl=pdl, gate_up_config=gu,
                                                             down_config=down))
            except Exception as error:  # noqa: BLE001 - a setting that does not compile
                print(f"gate/up {gu} down {down}: {type(error).__name__}: {error}", flush=True)
    best = min((r for r in rows if r["variant"].startswith("triton")), key=lambda r: r["us_per_layer"])
    print(f"best: {best}")
    if args.out:
        Path(args.out).write_text(json.dumps({"bytes_per_layer": read, "copy_bw_Bps": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
