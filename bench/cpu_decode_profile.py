"""Where a CPU decode step's time goes: matrix products against everything else (op dispatch,
norms, rotary, attention, Python), per token, from ``torch.profiler``.

    PYTHONPATH=src python bench/cpu_decode_profile.py [--model GGUF] [--threads 2] [--int4-decode]

Prints the wall time per token, the self time of the product kernels (int4 kernel, oneDNN /
MKL linear) and of the rest, and the ops called per token.
"""

from __future__ import annotations

import argparse
import time

PRODUCT_OPS = ("aten::_weight_int4pack_mm_for_cpu", "mkldnn::_linear_pointwise", "aten::addmm", "aten::mm",
               "aten::linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--int4-decode", action="store_true")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from redlite.engine.factory import load_engine

    torch.set_num_threads(args.threads)
    engine, _ = load_engine(args.model, ctx_size=512, device="cpu", int4_decode=args.int4_decode)
    logits = engine.prefill(list(range(1, 17)))
    for _ in range(4):
        logits = engine.decode(int(logits.argmax()))
    started = time.perf_counter()
    for _ in range(args.tokens):
        logits = engine.decode(int(logits.argmax()))
    wall = (time.perf_counter() - started) / args.tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.tokens):
            logits = engine.decode(int(logits.argmax()))
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / args.tokens / 1e3
    products = sum(e.self_cpu_time_total for e in events if e.key in PRODUCT_OPS) / args.tokens / 1e3
    calls = sum(e.count for e in events) / args.tokens
    print(f"threads {args.threads}, int4_decode {args.int4_decode}: {wall * 1e3:.1f} ms per token unprofiled "
          f"({1 / wall:.1f} tokens/s); profiled: products {products:.1f} ms, everything else "
          f"{total - products:.1f} ms ({(total - products) / total:.0%}), {calls:.0f} ops per token")


if __name__ == "__main__":
    main()
