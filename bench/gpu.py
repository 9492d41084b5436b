"""redlite's torch engine on a GPU against the measured memory-bandwidth and matmul ceilings,
with transformers' ``generate`` on the same weights side by side. One call, one process.

Usage::

    PYTHONPATH=src python3 bench/gpu.py --out DIR            # Qwen3-8B shape, ~3-5 min on an H200
    PYTHONPATH=src python3 bench/gpu.py --quick --out DIR    # 4 layers, fewer repeats: every path

The model has Qwen3-8B's shape (hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128,
intermediate 12288, vocab 151936, q/k RMSNorm, untied) with random weights: transformers
builds ``Qwen3ForCausalLM`` on the GPU in bfloat16 and redlite loads its ``state_dict()``.
Sections (each prints its rows as it goes; a failing section prints its error and the run
goes on; the JSON and markdown under ``--out`` are rewritten after every section):

1. ceilings: device-to-device copy bandwidth (bytes read + written per second) and a
   8192^3 bfloat16 matmul's TFLOP/s (medians, CUDA events).
2. checks: redlite's prefill logits against transformers' forward, graph decode against the
   eager decode.
3. decode: tokens/s at contexts 1k/8k/32k. The KV cache is filled with random values and
   ``n_past`` set directly (no long prefill needed); greedy ids read on the host every step.
   Bound = measured bandwidth / (weight bytes read per token + KV bytes at the context).
4. prefill: tokens/s for 1k/8k/32k prompts; FLOPs = 2 x (layer matmul parameters) per token
   + 2 x lm_head parameters (one position's logits) + causal attention (4 x heads x head_dim
   x P(P+1)/2 per layer), against the measured matmul rate.
5. ttft: second turn through ``redlite.core.generation.Generator`` (turn 1: a random prompt of
   the context size + 8 generated tokens; turn 2: that + 64 new tokens), time to the first
   streamed token with reuse and without (``GeneratorSettings(reuse=False)``, measured once),
   and the ideal: prefill of the 64 new tokens on the held state + one decode step.
6. transformers: ``generate`` decode tokens/s at a 1k prompt, default (dynamic) cache, static
   cache eager, static cache with its automatic ``torch.compile``; redlite likewise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_hf import HF_MODES, build_hf, hf_config, sync, transformers_side_by_side, ttft  # noqa: E402

R: dict = {"meta": {}, "ceilings": {}, "checks": {}, "decode": [], "decode_variants": [], "prefill": [],
           "ttft": [], "hf": [], "errors": []}


def say(*parts) -> None:
    print(*parts, flush=True)


def section(name: str, fn, *args, write=None):
    """Run ``fn(*args)`` as a titled section: an exception is printed and recorded in
    ``R["errors"]`` (then None is returned); the results are written after it either way
    (``write``: the writer, default :func:`write_results`)."""
    say(f"\n== {name} ==")
    started = time.perf_counter()
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - report and go on to the next section
        traceback.print_exc()
        sys.stdout.flush()
        R["errors"].append(f"{name}: {type(error).__name__}: {error}")
        return None
    finally:
        say(f"   ({name}: {time.perf_counter() - started:.1f} s)")
        (write or write_results)()


def timed(fn, device, reps: int, warm: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU)."""
    for _ in range(warm):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(device, dtype, quick):
    n = (1 << 29 if quick else 1 << 31) if device.type == "cuda" else 1 << 26
    src = torch.empty(n // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 10 if quick else 20)
    bw = 2 * n / seconds
    del src, dst
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, 5 if quick else 10, warm=3)
    R["ceilings"] = {"copy_bytes": 2 * n, "copy_bw_Bps": bw, "matmul_n": size,
                     "matmul_flops": 2 * size ** 3 / seconds}
    say(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write of {n / 2 ** 30:.1f} GiB); "
        f"{size}^3 {str(dtype)[6:]} matmul {R['ceilings']['matmul_flops'] / 1e12:.1f} TFLOP/s")


def model_sizes(model) -> dict:
    """Bytes read per decode token and matmul parameter counts of a LlamaModel."""
    spec, esize = model.spec, model.embed_weight.element_size()
    total = sum(p.numel() for p in model.parameters())
    embed = model.embed_weight.numel()
    read = (total - (0 if spec.tied else embed) + spec.hidden) * esize
    layer = sum(layer.attn.qkv_weight.numel() + layer.attn.o_weight.numel()
                + layer.mlp.gate_up_weight.numel() + layer.mlp.down_weight.numel() for layer in model.layers)
    kv_per_token = spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim * esize
    return {"weight_bytes_per_token": read, "layer_matmul_params": layer,
            "lm_head_params": model.lm_head_weight.numel(), "kv_bytes_per_token": kv_per_token,
            "params": total}


def checks(hf, engine, device):
    vocab = engine.vocab_size
    ids = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.reset()
    ours = engine.prefill(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device=device)).logits[0, -1].float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    from redlite.engine.torch_engine import TorchEngine

    eager = TorchEngine(engine.model, ctx_size=256, device=device, dtype=engine.dtype, cuda_graphs=False)
    a, b = eager.prefill(ids), ours
    worst = 0.0
    for _ in range(6):
        token = int(torch.argmax(a))
        a, b = eager.decode(token), engine.decode(token)
        worst = max(worst, ((a - b).norm() / a.norm()).item())
    del eager
    R["checks"] = {"prefill_vs_transformers_rel": rel, "graph_vs_eager_decode_rel": worst,
                   "decode_path": engine.decode_path}
    say(f"prefill logits vs transformers: relative error {rel:.2e}; graph vs eager decode "
        f"(6 tokens): {worst:.2e}; decode path {engine.decode_path}")


def decode_rate(engine, ctx, n_tokens, device) -> float:
    """Best of 2 runs of ``n_tokens`` greedy decode tokens/s at context ``ctx`` (random KV)."""
    engine.reset()
    with torch.inference_mode():
        engine.state.cache.data[:, :, :, :ctx].normal_()
    best = 0.0
    for rep in range(2):
        engine.state.n_past = ctx
        logits = engine.decode(1)
        for _ in range(3):  # warm-up (captures the graph the first time)
            logits = engine.decode(int(torch.argmax(logits)))
        engine.state.n_past = ctx  # (a rewind; also for states that cannot rewind)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            logits = engine.decode(int(torch.argmax(logits)))
        int(torch.argmax(logits))
        best = max(best, n_tokens / (time.perf_counter() - t0))
    return best


def decode_speed(engine, sizes, contexts, n_tokens, device):
    bw = R["ceilings"].get("copy_bw_Bps")
    for ctx in contexts:
        best = decode_rate(engine, ctx, n_tokens, device)
        kv = sizes["kv_bytes_per_token"] * (ctx + n_tokens / 2)
        # recurrent states (the hybrid family) are read and written once per token
        per_token = sizes["weight_bytes_per_token"] + kv + sizes.get("state_bytes_per_token", 0)
        bound = bw / per_token if bw else float("nan")
        row = {"context": ctx, "tok_s": best, "bytes_per_token": per_token, "kv_bytes": kv,
               "bound_tok_s": bound, "pct_of_bound": 100 * best / bound, "path": engine.decode_path}
        R["decode"].append(row)
        R.setdefault("decode_pct_of_bound", {})[str(ctx)] = row["pct_of_bound"]
        say(f"decode @ {ctx:>6}: {best:8.1f} tok/s   bound {bound:8.1f} tok/s "
            f"({per_token / 1e9:.2f} GB/token)   {row['pct_of_bound']:5.1f}%   [{engine.decode_path}]")
    engine.reset()


def decode_variants(engine, ctx, n_tokens, device):
    """Decode tokens/s at ``ctx`` with each decode-ops variant (fused Triton products or cuBLAS,
    with and without programmatic dependent launch), then back to the engine's default."""
    from redlite.engine.cuda_graphs import GraphDecoder
    from redlite.layers.triton_ops import TritonDecodeOps

    default = engine._graph_decoder
    R["decode_variants"] = []
    try:
        for fused, pdl, attention in ((True, 0, 0), (True, 1, 0), (True, 1, 1), (False, 0, 0)):
            ops = TritonDecodeOps(device, engine.model.spec.n_kv_heads, fused_gemv=fused, pdl=pdl,
                                  pdl_attention=attention)
            engine._graph_decoder = GraphDecoder(engine.model, engine.state, ops=ops)
            rate = decode_rate(engine, ctx, n_tokens, device)
            R["decode_variants"].append({"context": ctx, "ops": ops.name, "tok_s": rate})
            say(f"decode @ {ctx}: {rate:8.1f} tok/s with ops {ops.name}")
    finally:
        engine._graph_decoder = default
        engine.reset()


def eager_decode_speed(model, ctx, n_tokens, device, dtype):
    """The same model through the eager (no graph) decode, at one context, for reference."""
    from redlite.engine.torch_engine import TorchEngine

    engine = TorchEngine(model, ctx_size=ctx + n_tokens + 16, device=device, dtype=dtype, cuda_graphs=False)
    with torch.inference_mode():
        engine.state.cache.data[:, :, :, :ctx].normal_()
    engine.state.n_past = ctx
    logits = engine.decode(1)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        logits = engine.decode(int(torch.argmax(logits)))
    rate = n_tokens / (time.perf_counter() - t0)
    R["decode_eager"] = {"context": ctx, "tok_s": rate}
    say(f"eager decode (no CUDA graph) @ {ctx}: {rate:.1f} tok/s")


def prefill_speed(engine, sizes, lengths, device, quick):
    peak = R["ceilings"].get("matmul_flops")
    spec = engine.model.spec
    gen = torch.Generator().manual_seed(5)
    engine.reset()
    engine.prefill(torch.randint(0, engine.vocab_size, (min(512, engine.max_context),)).tolist())
    for length in lengths:
        ids = torch.randint(0, engine.vocab_size, (length,), generator=gen).tolist()
        reps = 1 if length > 8192 else (2 if quick else 3)
        best = float("inf")
        for _ in range(reps):
            engine.reset()
            sync(device)
            t0 = time.perf_counter()
            engine.prefill(ids)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        attn = spec.n_layers * 4 * spec.n_heads * spec.head_dim * length * (length + 1) / 2
        flops = 2 * sizes["layer_matmul_params"] * length + 2 * sizes["lm_head_params"] + attn
        row = {"tokens": length, "seconds": best, "tok_s": length / best, "flops": flops,
               "tflops": flops / best / 1e12, "pct_of_matmul_peak": 100 * flops / best / peak if peak else None}
        R["prefill"].append(row)
        say(f"prefill {length:>6}: {row['tok_s']:10.0f} tok/s  {best * 1e3:9.1f} ms  "
            f"{row['tflops']:6.1f} TFLOP/s  {row['pct_of_matmul_peak'] or float('nan'):5.1f}% of matmul peak")
    engine.reset()


def write_results() -> None:
    out = R["meta"].get("out")
    if not out:
        return
    from gpu_report import markdown

    stem = Path(out) / R["meta"]["stem"]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(R))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for the JSON and markdown results")
    parser.add_argument("--quick", action="store_true", help="4 layers and fewer repeats")
    parser.add_argument("--layers", type=int, help="layers (default 36; 4 with --quick)")
    parser.add_argument("--decode-tokens", type=int, help="timed decode tokens (default 128; 32 quick)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CPU smoke test
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: "
                        "decode,prefill,ttft,hf,hf-compile")
    args = parser.parse_args()
    from gpu_report import markdown, meta

    device = torch.device(args.device)
    dtype = torch.bfloat16
    layers = args.layers or (4 if args.quick else 36)
    n_decode = args.decode_tokens or (32 if args.quick else 128)
    skip = set(filter(None, args.skip.split(",")))
    R["meta"] = meta(device, layers, args.quick, args.out)
    say(json.dumps({k: v for k, v in R["meta"].items() if k != "notes"}))
    section("ceilings", ceilings, device, dtype, args.quick)

    from redlite.engine.torch_engine import TorchEngine
    from redlite.models.llama import LlamaModel

    started = time.perf_counter()
    config = hf_config(layers)
    if args.tiny:
        for key, value in dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, vocab_size=1000).items():
            setattr(config, key, value)
    hf = build_hf(config, device, dtype)
    model = LlamaModel(config.to_dict(), device=device, dtype=dtype)
    model.load_hf_weights(hf.state_dict())
    sync(device)
    sizes = model_sizes(model)
    R["meta"]["sizes"] = sizes
    contexts_tt = [1024, 16384, 65536] if device.type == "cuda" else [256, 1024]
    engine = TorchEngine(model, ctx_size=max(contexts_tt) + 1024, device=device, dtype=dtype)
    say(f"models built in {time.perf_counter() - started:.1f} s: {sizes['params'] / 1e9:.2f} B parameters, "
        f"{sizes['weight_bytes_per_token'] / 1e9:.2f} GB read per decode token; engine context {engine.max_context}")
    section("checks", checks, hf, engine, device)
    small = device.type != "cuda"
    if "decode" not in skip:
        section("decode", decode_speed, engine, sizes, [256, 1024] if small else [1024, 8192, 32768], n_decode, device)
        if device.type == "cuda":
            section("decode variants", decode_variants, engine, 1024, n_decode, device)
        section("decode (eager)", eager_decode_speed, model, 1024, min(n_decode, 32), device, dtype)
    if "prefill" not in skip:
        section("prefill", prefill_speed, engine, sizes, [256, 1024] if small else [1024, 8192, 32768], device, args.quick)
    if "ttft" not in skip:
        section("ttft", ttft, R, engine, contexts_tt, device)
    if "hf" not in skip:
        modes = [m for m in HF_MODES if "compile" not in m or ("hf-compile" not in skip and not small)]
        section("transformers", transformers_side_by_side, R, hf, engine, device, 256 if small else 1024,
                16 if small else (32 if args.quick else 64), modes, write_results)
    write_results()
    say("\n" + markdown(R))


if __name__ == "__main__":
    main()
