"""Short prefills on the GPU: what a second turn or a fork's suffix (1-64 tokens) costs
eagerly against the captured decode step, per shape, and where an eager piece spends its time.

Usage (CUDA)::

    PYTHONPATH=src python3 bench/short_prefill.py --tokenizer DIR --shapes 1b,8b,hybrid9b \\
        [--held 8192] [--sizes 1,2,4,8,20,64] [--profile 20] [--out DIR]

Per shape (bench/serve_gpu.py's random-weight models): ``--held`` random KV rows (and, for the
hybrid, states as they are), then for each size T the best of 5 of ``engine.prefill(T ids)``
(eager), of ``engine.prefill`` as the server runs it after the start-up warm-up (which sets
``graph_prefill_tokens``), and of T graph decode steps, each to the first id read
back. ``--profile T``: a torch.profiler table (self CPU time) of one eager T-token prefill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
import serve_gpu  # noqa: E402


def timed(fn, reps: int = 5) -> float:
    best = float("inf")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def run_shape(shape: str, args, eos, vocab: int) -> dict:
    from redlite.engine.torch_engine import TorchEngine

    ctx = args.held + 2048
    if shape in serve_gpu.HYBRID:
        _cfg, model = serve_gpu.hybrid_model(shape, vocab, ctx, eos)
    else:
        from redlite.models.llama import LlamaModel

        cfg, tensors = serve_gpu.llama_tensors(shape, vocab, ctx, eos)
        model = LlamaModel(cfg, device=serve_gpu.DEVICE, dtype=torch.bfloat16)
        model.load_hf_weights(tensors)
        del tensors
    model.eval()
    if args.fla_recurrent_max is not None:
        for module in model.modules():
            if hasattr(module, "recurrent_max_tokens"):
                module.recurrent_max_tokens = args.fla_recurrent_max
    engine = TorchEngine(model, ctx_size=ctx, device=serve_gpu.DEVICE, dtype=torch.bfloat16)
    from redlite.engine.warmup import warm_up

    report = warm_up(engine)
    out: dict = {"held": args.held, "sizes": {}, "warmup_s": report.seconds,
                 "graph_prefill_tokens": engine.graph_prefill_tokens}
    print(f"[{shape}] warm-up {report.seconds:.1f} s; graph_prefill_tokens {engine.graph_prefill_tokens}", flush=True)

    def at_held():
        engine.reset()
        engine.state.n_past = args.held

    def eager(n):
        def go():
            at_held()
            engine.graph_prefill_tokens, keep = 0, engine.graph_prefill_tokens
            int(torch.argmax(engine.prefill(list(range(5, 5 + n)))))
            engine.graph_prefill_tokens = keep
        return go

    def served(n):
        def go():
            at_held()
            int(torch.argmax(engine.prefill(list(range(5, 5 + n)))))
        return go

    def stepped(n):
        def go():
            at_held()
            for i in range(n):
                logits = engine.decode(5 + i)
            int(torch.argmax(logits))
        return go

    for n in args.sizes:
        row = {"eager_ms": timed(eager(n)), "prefill_ms": timed(served(n)), "graph_steps_ms": timed(stepped(n))}
        out["sizes"][n] = row
        print(f"[{shape}] T={n:3d}: eager prefill {row['eager_ms']:7.2f} ms, engine.prefill {row['prefill_ms']:7.2f} ms, "
              f"{n} graph steps {row['graph_steps_ms']:7.2f} ms", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        eager(args.profile)()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eager(args.profile)()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        print(table, flush=True)
        out["profile"] = table
        events = prof.key_averages()
        out["cuda_launches"] = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                        "cudaLaunchKernelExC", "cuLaunchKernelEx"))
        print(f"[{shape}] kernel launches in one {args.profile}-token eager prefill: {out['cuda_launches']}")
    del engine, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1b,8b,hybrid9b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--held", type=int, default=8192)
    parser.add_argument("--sizes", default="1,2,4,8,20,64")
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fla-recurrent-max", type=int, default=None,
                        help="hybrid: set each Gated DeltaNet layer's recurrent_max_tokens (A/B of the fla kernels)")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    from redlite.loading.tokenizer import load_tokenizer

    tok_dir = Path(args.tokenizer)
    tokenizer = load_tokenizer(tok_dir)
    config = tok_dir / "config.json"
    vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else len(tokenizer.tokenizer)
    eos = tokenizer.eos_token_ids
    results = {}
    for shape in args.shapes.split(","):
        results[shape] = run_shape(shape, args, eos, vocab)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "short_prefill.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
