"""Launch settings of the fused mixture-of-experts decode step (redlite.layers.triton_moe) on a
GPU: the Qwen3.5-35B-A3B block (256 experts, 8 per token, widths 512, hidden 2048) timed as a
graph of one step per layer over distinct layers (so no weight comes from L2), for each pair
of settings of the down kernel (gate/up at its default), then of the gate/up kernel (down at
its best), then of the routing kernel's warps (or no routing kernel: each gate/up program routes), then of the router product's GEMV (None: its table's),
against the bytes the step reads (router,
shared expert, the 8 chosen experts); then the best with PDL, and with PDL each combination of
``VARIANTS`` (the gate/up kernel's shared block and the down kernel's weight reads before
their waits, ``early``) with the down settings of ``DOWN_PDL``, then with the best of those the
``ISOLATE`` rows (one early read alone) and the gate/up settings of ``GATE_UP_PDL``; then the
kernel split of the best (µs and GB/s per kernel). One process, about a minute.

Usage: ``PYTHONPATH=src python3 bench/moe_tune.py [--out FILE.json]``; bench/hybrid.py runs
:func:`sweep` on the 35b-a3b model's own layers before it captures the decode graph.
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

GATE_UP = [(4, 2048, 4, 0), (4, 512, 4, 0), (8, 512, 4, 0), (2, 2048, 4, 0), (4, 2048, 8, 0), (4, 2048, 4, 2),
           (4, 2048, 8, 1), (2, 2048, 4, 4), (2, 2048, 4, 3), (4, 2048, 4, 3)]  # (block_n, block_k, warps, per SM)
DOWN = [(4, 512, 4), (4, 512, 8), (2, 512, 4), (1, 512, 4), (8, 512, 8), (4, 256, 4), (8, 256, 8),
        (2, 256, 2)]  # (block_n, block_i, num_warps)
ROUTE_WARPS = [1, 2, 4, 0]  # 0: no routing kernel, each gate/up program routes
ROUTER = [None, (1, 2048, 4, 1, 0), (2, 2048, 4, 1, 0), (1, 2048, 8, 1, 0), (2, 1024, 4, 1, 0)]  # gemv settings
DOWN_PDL = [(2, 256, 2), (1, 512, 2), (2, 512, 4), (4, 512, 4)]  # down settings also tried in the PDL variants
GATE_UP_PDL = [(2, 2048, 4, 3), (4, 2048, 4, 2)]  # gate/up settings tried with the best of those
#: moe_step options: the plain rows and the first PDL rows take OLD (no early reads); the
#: PDL variants are NEW and these changes of it, by name (route_warps 0: routing in gate/up)
OLD = dict(down_early=False, gate_up_early=False)
NEW = dict(down_early=True, gate_up_early=True)
VARIANTS = {"early": {}, "early in-gate-up": dict(route_warps=0)}
ISOLATE = {"down-early only": dict(gate_up_early=False), "gate/up-early only": dict(down_early=False)}


def sweep(layers, device, bw: float | None, say=print, apply: bool = False) -> list[dict]:
    """Time the MoE step over ``layers`` ([(SparseMoE, x [1, H], norm weight [H])], distinct
    layers) as one graph, with the torch reference and each setting of one kernel at a time,
    the others at their best so far (plain launches), then the best with PDL. Returns rows;
    ``apply``: make the best settings the defaults
    of :mod:`redlite.layers.triton_moe` (before any graph is captured)."""
    from redlite.layers import triton_gemv, triton_moe
    from redlite.layers.decode_ops import TorchDecodeOps

    moe = layers[0][0]
    h, e, k = moe.gates_weight.shape[1], moe.num_experts, moe.top_k
    read = moe.gates_weight.element_size() * (h * (e + 1) + 3 * h * moe.shared.inter + k * 3 * h * moe.inter)
    rows = []

    def measure(label, step, **extra):
        for m, x, nw in layers:
            step(m, x, nw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for m, x, nw in layers:
                step(m, x, nw)
        us = gpu.timed(graph.replay, device, 30) / len(layers) * 1e6
        row = {"variant": label, "us_per_layer": us, "bytes_per_layer": read, "GBps": read / us / 1e3,
               "pct_of_copy_bw": 100 * read / (us * 1e-6) / bw if bw else None, **extra}
        rows.append(row)
        say(f"moe step {label:>34}: {us:7.2f} us/layer  {row['GBps']:6.0f} GB/s  "
            f"{row['pct_of_copy_bw'] or float('nan'):5.1f}% of copy bandwidth")

    def triton_step(gu, down, pdl, warps=None, options=None):  # warps 0: routing in gate/up
        return lambda m, x, nw: triton_moe.moe_step(x, nw, 1e-6, m, pdl=pdl, gate_up_config=gu, down_config=down,
                                                    route_warps=warps or None, route_in_gate_up=warps == 0,
                                                    **(options or OLD))

    def best_row():
        return min((r for r in rows if "gate_up" in r), key=lambda r: r["us_per_layer"])

    router_key = (triton_gemv.PLAIN, e + 1, h)
    table_router = triton_gemv.GEMV_CONFIGS.get(router_key)

    def set_router(config):
        if config or table_router:
            triton_gemv.GEMV_CONFIGS[router_key] = config or table_router
        else:
            triton_gemv.GEMV_CONFIGS.pop(router_key, None)

    def try_measure(gu, down, warps, router=None):
        set_router(router)
        try:
            measure(f"gate/up {gu} down {down} route {warps} router {router} pdl 0", triton_step(gu, down, 0, warps),
                    gate_up=gu, down=down, route_warps=warps, router=router, pdl=0)
        except Exception as error:  # noqa: BLE001 - a setting that does not compile
            say(f"gate/up {gu} down {down} route {warps} router {router}: {type(error).__name__}: {error}")

    with torch.inference_mode():
        ref = TorchDecodeOps()
        measure("torch gathered (reference)", lambda m, x, nw: ref.moe(x, nw, 1e-6, m))
        for down in DOWN:
            try_measure(triton_moe.GATE_UP_CONFIG, down, triton_moe.ROUTE_WARPS)
        for gu in GATE_UP:
            if gu != triton_moe.GATE_UP_CONFIG:
                try_measure(gu, best_row()["down"], triton_moe.ROUTE_WARPS)
        for warps in ROUTE_WARPS:
            if warps != triton_moe.ROUTE_WARPS:
                try_measure(best_row()["gate_up"], best_row()["down"], warps)
        for router in ROUTER[1:]:
            try_measure(best_row()["gate_up"], best_row()["down"], best_row()["route_warps"], router)
        best = best_row()
        gu, down, warps, router = best["gate_up"], best["down"], best["route_warps"], best["router"]
        set_router(router)
        for route in dict.fromkeys([warps, 0 if warps else triton_moe.ROUTE_WARPS or 1]):  # both routings with PDL
            measure(f"gate/up {gu} down {down} route {route} router {router} pdl 1", triton_step(gu, down, 1, route),
                    gate_up=gu, down=down, route_warps=route, router=router, pdl=1)
        route = warps or triton_moe.ROUTE_WARPS or 1

        def pdl_measure(g, d, name, options):
            options = dict(options)
            r = options.pop("route_warps", route)
            label = f"gate/up {g} down {d} route {r} router {router} pdl 1 {name}"
            try:
                measure(label, triton_step(g, d, 1, r, options), gate_up=g, down=d, route_warps=r,
                        router=router, pdl=1, options=options)
            except Exception as error:  # noqa: BLE001 - a setting that does not compile
                say(f"{label}: {type(error).__name__}: {error}")

        if tuple(down) != tuple(DOWN_PDL[0]):
            pdl_measure(gu, DOWN_PDL[0], "as before", OLD)
        for d in dict.fromkeys([tuple(down)] + DOWN_PDL):
            for name, change in VARIANTS.items():
                pdl_measure(gu, d, name, {**NEW, **change})
        with_pdl = min((r for r in rows if r.get("pdl") == 1), key=lambda r: r["us_per_layer"])
        options = with_pdl.get("options", OLD)
        for name, change in ISOLATE.items():
            pdl_measure(gu, with_pdl["down"], name, {**options, **change, "route_warps": with_pdl["route_warps"]})
        for g in GATE_UP_PDL:
            if tuple(g) != tuple(gu):
                pdl_measure(g, with_pdl["down"], "as the best", {**options, "route_warps": with_pdl["route_warps"]})
        with_pdl = min((r for r in rows if r.get("pdl") == 1), key=lambda r: r["us_per_layer"])
        best = {**best, "gate_up": with_pdl["gate_up"], "route_warps": with_pdl["route_warps"],
                "down": with_pdl["down"], "options": with_pdl.get("options", OLD)}
        gu, warps, down = best["gate_up"], best["route_warps"], best["down"]
        try:
            rows.append(kernel_split(layers, triton_step(gu, down, 0, warps, best["options"]), say))
        except Exception as error:  # noqa: BLE001 - a profiler that does not run here
            say(f"moe step kernel split: {type(error).__name__}: {error}")
    set_router(best["router"] if apply else None)
    if apply:
        triton_moe.GATE_UP_CONFIG, triton_moe.DOWN_CONFIG = tuple(best["gate_up"]), tuple(best["down"])
        triton_moe.ROUTE_IN_GATE_UP = best["route_warps"] == 0
        triton_moe.ROUTE_WARPS = best["route_warps"] or triton_moe.ROUTE_WARPS
        opts = best.get("options", OLD)
        triton_moe.DOWN_EARLY, triton_moe.GATE_UP_EARLY = opts["down_early"], opts["gate_up_early"]
        say(f"moe step settings: gate/up {best['gate_up']}, down {best['down']}, route warps {best['route_warps']}, "
            f"router gemv {best['router'] or 'from its table'}, {opts}")
    return rows


def kernel_bytes(moe) -> dict[str, int]:
    """Bytes each kernel of the step reads from weights (by kernel-name prefix)."""
    h, e, k = moe.gates_weight.shape[1], moe.num_experts, moe.top_k
    size = moe.gates_weight.element_size()
    return {"_gemv_kernel": size * h * (e + 1), "_gate_up_kernel": size * 2 * h * (k * moe.inter + moe.shared.inter),
            "_down_kernel": size * h * (k * moe.inter + moe.shared.inter)}


def kernel_split(layers, step, say=print, reps: int = 5) -> dict:
    """Microseconds per layer of each kernel of ``step`` (CUDA kernel durations from
    torch.profiler, launch gaps excluded) over ``reps`` passes of ``layers``, and the GB/s of
    the weight-reading ones."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for m, x, nw in layers:
                step(m, x, nw)
        torch.cuda.synchronize()
    per = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            per[event.key] = event.device_time_total / (reps * len(layers))
    read = kernel_bytes(layers[0][0])
    gbps = {key: b / per[name] / 1e3 for key, b in read.items() for name in per if name.startswith(key)}
    say("moe step kernels (us per layer): " + ", ".join(
        f"{k[:40]} {v:.2f}" + (f" ({gbps[k]:.0f} GB/s)" if k in gbps else "") for k, v in sorted(per.items())))
    return {"variant": "kernel split of the best (us per layer)", "kernels_us": per, "kernels_GBps": gbps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
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
    gpu.ceilings(device, dtype, True)
    rows = sweep(layers, device, gpu.R["ceilings"].get("copy_bw_Bps"))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
