"""Engine-level batched decode: aggregate decode tokens/s of N slots of one
:class:`~redlite.engine.torch_engine.TorchEngine` pool stepped together through
``decode_batch`` (one forward per step for all N), against N = 1.

Usage::

    PYTHONPATH=src python3 bench/batch_decode.py                       # CPU, bundled model, 1/2/4/8
    PYTHONPATH=src python3 bench/batch_decode.py --device cuda         # Qwen3-8B shape, random bf16, 1/8/32
    PYTHONPATH=src python3 bench/batch_decode.py --out bench/results   # also writes JSON + markdown

CPU: the bundled SmolLM2-135M (Q4_1, fused C step); every slot prefills its own prompt
(``--context`` random token ids) and then decodes greedily. CUDA: Qwen3-8B's shape (as
``bench/gpu.py``, ``--layers`` to shorten) with random bfloat16 weights; every slot's KV cache
holds ``--context`` random rows (no prefill needed). Each step reads every slot's greedy token
on the host, as serving does. N = 1 goes through the slot's own decode (the CUDA-graph path on
CUDA); N >= 2 through one eager batched forward. :func:`measure` is the function other
benches call.
"""

from __future__ import annotations

import sys
from pathlib import Path

# this folder last on the path: its concurrent.py would hide the standard library's package
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p != _HERE] + [_HERE]

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(pool, slots: list, context: int, steps: int, fill: str = "prefill", warm: int = 3) -> dict:
    """Aggregate decode rate of ``slots`` (distinct slots of ``pool``, all used) over ``steps``
    steps after ``warm`` untimed ones; each slot first holds ``context`` tokens (``fill``:
    ``"prefill"`` random ids, or ``"random"`` KV rows written directly). Returns ``{"slots",
    "context", "agg_tok_s", "stream_tok_s", "step_ms"}``."""
    device = pool.device
    gen = torch.Generator().manual_seed(0)
    logits = []
    for slot in slots:
        slot.reset()
        if fill == "prefill":
            ids = torch.randint(0, pool.vocab_size, (context,), generator=gen).tolist()
            logits.append(slot.prefill(ids))
        else:
            with torch.inference_mode():
                slot.state.cache.data[:, :, :, :context].normal_()
            slot.state.n_past = context
    # (random fill: the first token is 1, so no slot decodes alone and captures its own graphs)
    tokens = [int(torch.argmax(x)) for x in logits] if logits else [1] * len(slots)
    for _ in range(warm):
        tokens = [int(torch.argmax(x)) for x in pool.decode_batch(slots, tokens)]
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        tokens = [int(torch.argmax(x)) for x in pool.decode_batch(slots, tokens)]
    sync(device)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(slots)
    return {"slots": n, "context": context, "agg_tok_s": n * steps / elapsed, "stream_tok_s": steps / elapsed,
            "step_ms": 1000 * elapsed / steps, "tok_per_cpu_s": n * steps / cpu}


def cpu_pool(ctx_size: int):
    from redlite.engine.torch_engine import TorchEngine
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.hf import load_hf_model

    model, _ = load_hf_model(resolve_model_dir(bundled_model_path()), "cpu", torch.float32)
    return TorchEngine(model, model_id="SmolLM2-135M-Q4_1", ctx_size=ctx_size, device="cpu"), "prefill"


def shape_pool(ctx_size: int, layers: int, device: str = "cuda", tiny: bool = False):
    """A pool over a Qwen3-8B-shaped Llama-family model with random bfloat16 weights on
    ``device`` (``tiny``: hidden 256, vocab 1000, for a CPU smoke run of this path)."""
    from gpu_hf import QWEN3_8B

    from redlite.engine.torch_engine import TorchEngine
    from redlite.models.llama import LlamaModel

    device, dtype = torch.device(device), torch.bfloat16
    config = dict(QWEN3_8B, num_hidden_layers=layers, model_type="qwen3")
    if tiny:
        config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, vocab_size=1000)
    model = LlamaModel(config, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    name = f"qwen3-8b-shape-{layers}l" + ("-tiny" if tiny else "")
    return TorchEngine(model, model_id=name, ctx_size=ctx_size, device=device, dtype=dtype,
), "random"


def path_of(pool) -> str:
    """How the pool decoded its last batch: ``graph`` (batched CUDA graphs), ``fused C`` (the
    CPU step) or ``eager``."""
    graphs = pool._shared.get("batch_graphs")
    if graphs:
        return f"batched graph ({graphs.captures} captures)" if graphs.use_graphs else "batched static-eager"
    fused = getattr(pool.model, "_fused", None)
    return "batched fused C" if fused is not None and fused() is not None else "batched eager"


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Batched decode, {meta['device']} ({meta['date']})", "",
             f"Model {meta['model']}; context {meta['context']} tokens per slot; {meta['steps']} timed steps; "
             f"load average before the run {meta['load']}; best of {meta['rounds']} interleaved rounds; "
             f"command `{meta['command']}`.", "",
             "| slots | aggregate tok/s | per stream tok/s | step ms | aggregate vs 1 slot | tok per CPU-s | vs 1 slot |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    base, base_cpu = result["rows"][0]["agg_tok_s"], result["rows"][0]["tok_per_cpu_s"]
    for row in result["rows"]:
        lines.append(f"| {row['slots']} | {row['agg_tok_s']:.1f} | {row['stream_tok_s']:.1f} | "
                     f"{row['step_ms']:.1f} | {row['agg_tok_s'] / base:.2f}x | {row['tok_per_cpu_s']:.1f} | "
                     f"{row['tok_per_cpu_s'] / base_cpu:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", choices=["bundled", "8b"], help="model (default: bundled on CPU, 8b on CUDA)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CPU smoke run of --shape 8b
    parser.add_argument("--slots", help="comma-separated slot counts (default 1,2,4,8 CPU; 1,8,32 CUDA)")
    parser.add_argument("--context", type=int, help="tokens each slot holds (default 64 CPU, 1024 CUDA)")
    parser.add_argument("--steps", type=int, help="timed steps (default 32 CPU, 64 CUDA)")
    parser.add_argument("--layers", type=int, default=36, help="layers of the CUDA model (default 36)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every count this many times, interleaved, and keep the best (noisy hosts)")
    parser.add_argument("--threads", type=int, help="CPU threads (torch and the C kernels; default as torch)")
    parser.add_argument("--out", help="folder for JSON + markdown results")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    shape = args.shape or ("8b" if cuda else "bundled")
    counts = [int(n) for n in (args.slots or ("1,8,32" if cuda else "1,2,4,8")).split(",")]
    context = args.context or (1024 if cuda else 64)
    steps = args.steps or (64 if cuda else 32)
    if args.threads:
        from redlite.kernels import native

        torch.set_num_threads(args.threads)
        native.set_threads(args.threads)
    load = os.getloadavg()[0]
    size = context + steps + 64
    pool, fill = shape_pool(size, args.layers, args.device, args.tiny) if shape == "8b" else cpu_pool(size)
    slots = [pool] + [pool.new_slot() for _ in range(max(counts) - 1)]
    best: dict[int, dict] = {}
    for _ in range(max(1, args.rounds)):
        for n in counts:
            row = measure(pool, slots[:n], context, steps, fill)
            row["path"] = pool.decode_path if n == 1 else path_of(pool)
            print(f"{n:>3} slots: {row['agg_tok_s']:8.1f} tok/s aggregate, {row['stream_tok_s']:7.1f} per stream, "
                  f"{row['step_ms']:6.1f} ms/step, {row['tok_per_cpu_s']:7.1f} tok/CPU-s  [{row['path']}]", flush=True)
            if n not in best or row["agg_tok_s"] > best[n]["agg_tok_s"]:
                best[n] = row
    rows = [best[n] for n in dict.fromkeys(counts)]
    device = torch.cuda.get_device_name() if cuda else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    result = {"meta": {"device": device, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "model": pool.model_id, "context": context, "steps": steps, "load": round(load, 2),
                       "rounds": max(1, args.rounds),
                       "command": "python3 bench/batch_decode.py " + " ".join(sys.argv[1:])},
              "rows": rows}
    text = markdown(result)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"batch-decode-{datetime.now(timezone.utc):%Y-%m-%d}-{'cuda' if cuda else 'cpu'}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
        (out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
