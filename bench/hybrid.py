"""redlite's Qwen3.5 hybrid (Gated DeltaNet + gated attention) engine against the measured
memory-bandwidth and matmul ceilings, with transformers' Qwen3.5 side by side. One process.

Usage::

    PYTHONPATH=src python3 bench/hybrid.py --device cuda --out DIR      # 9B shape, H200: minutes
    PYTHONPATH=src python3 bench/hybrid.py                              # 0.8B shape, CPU, small sizes
    PYTHONPATH=src python3 bench/hybrid.py --device cuda --shape 35b-a3b  # the MoE shape (~70 GB bf16)

The model has the published Qwen3.5 dense shape (``--shape 9b``: hidden 4096, 32 layers of
which every 4th is gated full attention, 16 q / 4 kv heads of 256, 16 key / 32 value heads of
128 in the Gated DeltaNet layers, vocab 248320) with random weights: transformers builds
``Qwen3_5ForCausalLM`` (with flash-linear-attention's kernels where fla is installed) and
redlite loads its ``state_dict()`` (the mixture-of-experts shape ``35b-a3b`` shares
transformers' expert tensors instead of copying them, see bench/hybrid_moe.py). Sections (a failing one prints its error, the run goes on;
the JSON and markdown under ``--out`` are rewritten after every section):

1. ceilings: device-to-device copy bandwidth and a 8192^3 matmul (as bench/gpu.py).
2. checks: prefill logits against transformers' forward; graph decode against eager decode.
3. decode at 1k/8k/32k context (1k/8k for 35b-a3b): KV rows filled with random values and ``n_past`` set directly;
   bound = bandwidth / (weight bytes + KV bytes at the mean context + recurrent and conv state
   read and written once per token; a MoE layer counts its router, its shared expert and
   ``num_experts_per_tok`` routed experts). Per-kernel split: the same step with ops left out.
4. prefill at 8k: FLOPs = 2 x layer matmul parameters per token + 2 x lm_head parameters + causal
   attention 4 x heads x head_dim x P(P+1)/2 per full-attention layer + the chunked delta rule,
   per token and value head 6 Dk Dv + 4 C Dk + 2 C Dv (C = 64, the chunk). transformers'
   forward over the same length beside it (35b-a3b; skip with ``hf-prefill``).
5. fork: second turn after a fork 64 tokens before the end of a 32k conversation (the first turn's
   last message boundary): time to the first token with reuse (checkpoint restore + prefill of 64
   + first token) and without (``GeneratorSettings(reuse=False)``).
6. transformers: ``generate`` decode tokens/s at a 1k prompt next to redlite's (the modes of
   gpu_hf.HF_MODES, static cache + torch.compile included; skip with ``hf-generate``).

``--profile-step FILE``: after the split, bench/hybrid_profile.py's per-kernel tables of the graph
decode step at each decode context (time, bytes and TB/s per role, the graph's launch cost).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import gpu  # noqa: E402  (ceilings, timing, the shared results dict)
from gpu_hf import StubTokenizer, first_token_s, sync, transformers_side_by_side  # noqa: E402
from hybrid_moe import build_sharing_experts, hf_prefill_speed, moe_step_tune  # noqa: E402
from hybrid_report import SHAPES, build_hf, markdown, meta, model_sizes  # noqa: E402

R = gpu.R
R.update({"checks": {}, "decode": [], "decode_split": [], "prefill": [], "fork": [], "hf": []})


say = gpu.say


def section(name, fn, *args):
    return gpu.section(name, fn, *args, write=write_results)


def write_results() -> None:
    out = R["meta"].get("out")
    if out:
        stem = Path(out) / R["meta"]["stem"]
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))
        stem.with_suffix(".md").write_text(markdown(R))


def checks(hf, engine, device):
    from redlite.engine.torch_engine import TorchEngine

    ids = torch.randint(0, engine.vocab_size, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.reset()
    ours = engine.prefill(ids)
    if hf is not None:
        with torch.inference_mode():
            ref = hf(torch.tensor([ids], device=device)).logits[0, -1].float()
        R["checks"]["prefill_vs_transformers_rel"] = ((ours - ref).norm() / ref.norm()).item()
    eager = TorchEngine(engine.model, ctx_size=256, device=device, dtype=engine.dtype, cuda_graphs=False)
    a, b, worst = eager.prefill(ids), ours, 0.0
    for _ in range(6):
        token = int(torch.argmax(a))
        a, b = eager.decode(token), engine.decode(token)
        worst = max(worst, ((a - b).norm() / a.norm()).item())
    del eager
    R["checks"].update(graph_vs_eager_decode_rel=worst, decode_path=engine.decode_path)
    say(f"checks: {R['checks']}")


def decode_split(engine, ctx, device, reps=50):
    """Milliseconds per decode step with the Gated DeltaNet step, the attention, or every
    matrix product left out (their outputs reused): where the time goes."""
    from redlite.layers import decode_ops as dops

    ops = dops.decode_ops(device, engine.dtype, engine.model.text_config["head_dim"],
                          engine.state.cache.data.shape[2], engine.model.linear)
    model, state = engine.model, engine.state
    engine.reset()
    state.n_past = ctx
    token = torch.ones(1, dtype=torch.long, device=device)
    pos = torch.full((1,), ctx, dtype=torch.long, device=device)
    cached = {}

    class Skip(type(ops)):
        def __init__(self, leave_out):
            self.__dict__.update(ops.__dict__)
            self.leave_out = leave_out

        def __getattribute__(self, name):
            fn = object.__getattribute__(self, name)
            if name in object.__getattribute__(self, "__dict__").get("leave_out", ()):
                def reuse(*args, **kwargs):
                    # keyed by the weights / layer (fresh activations differ per call)
                    key = (name,) + tuple(id(a) for a in args if isinstance(a, (nn.Parameter, nn.Module)))
                    if key not in cached:
                        cached[key] = fn(*args, **kwargs)
                    return {"linear_residual": args[3], "moe": args[0]}.get(name, cached[key])
                return reuse
            return fn

    variants = {"full step": (), "no GDN step": ("gdn_step",), "no attention": ("gated_rope_attend",),
                "no matrix products": ("norm_linear", "linear_residual", "norm_gate_up", "moe")}
    if any(layer.moe for layer in model.layers):
        variants["no MoE block"] = ("moe",)
    for label, leave_out in variants.items():
        variant = Skip(set(leave_out))
        with torch.inference_mode():
            model.decode_step(token, pos, state, state.max_tokens, variant)  # fill the reuse cache
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.decode_step(token, pos, state, state.max_tokens, variant)
        seconds = gpu.timed(graph.replay, device, reps)
        R["decode_split"].append({"variant": label, "context": ctx, "ms": seconds * 1e3})
        say(f"decode step @ {ctx} {label:>20}: {seconds * 1e3:7.3f} ms")
        cached.clear()
    engine.reset()


def profile_steps(engine, contexts, device, path):
    """bench/hybrid_profile.py's per-kernel tables of the graph decode step at each context,
    into the markdown file ``path`` and ``R["step_profile"]``."""
    import hybrid_profile

    lines = []
    R["step_profile"] = []
    for ctx in contexts:
        result = hybrid_profile.profile_step(engine.model, engine.state, ctx, device, engine.dtype,
                                             R["ceilings"].get("copy_bw_Bps"), say=say)
        lines += result.pop("md") + [""]
        R["step_profile"].append(result)
    Path(path).write_text("\n".join(lines) + "\n")
    engine.reset()


def prefill_speed(engine, sizes, lengths, device):
    peak = R["ceilings"].get("matmul_flops")
    cfg = engine.model.text_config
    gen = torch.Generator().manual_seed(5)
    engine.reset()
    engine.prefill(torch.randint(0, engine.vocab_size, (512,)).tolist())  # warm-up
    n_full = sum(t == "full_attention" for t in cfg["layer_types"])
    n_linear = len(cfg["layer_types"]) - n_full
    dk, dv, chunk = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], 64
    rule_per_token = n_linear * cfg["linear_num_value_heads"] * (6 * dk * dv + 4 * chunk * dk + 2 * chunk * dv)
    from redlite.layers.gated_deltanet import fla_available

    for length in lengths:
        ids = torch.randint(0, engine.vocab_size, (length,), generator=gen).tolist()
        best = float("inf")
        for _ in range(1 if length > 8192 else 3):
            engine.reset()
            sync(device)
            t0 = time.perf_counter()
            engine.prefill(ids)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        attn = n_full * 4 * cfg["num_attention_heads"] * cfg["head_dim"] * length * (length + 1) / 2
        flops = 2 * sizes["layer_matmul_params"] * length + 2 * sizes["lm_head_params"] + attn + rule_per_token * length
        row = {"engine": "redlite", "tokens": length, "seconds": best, "tok_s": length / best, "flops": flops,
               "tflops": flops / best / 1e12, "pct_of_matmul_peak": 100 * flops / best / peak if peak else None,
               "fla": fla_available(device)}
        R["prefill"].append(row)
        say(f"prefill {length:>6}: {row['tok_s']:10.0f} tok/s  {best * 1e3:9.1f} ms  {row['tflops']:6.1f} TFLOP/s  "
            f"{row['pct_of_matmul_peak'] or float('nan'):5.1f}% of matmul peak  (fla {row['fla']})")
    engine.reset()


def fork(engine, ctx, device, profile_to=None, tail=64, gen_tokens=8):
    """Second-turn time to first token after a fork ``tail`` tokens before the end of the
    ``ctx``-token first turn (its last message boundary), with and without reuse."""
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GenerationRequest, GeneratorSettings
    from redlite.engine.base import SamplingParams

    rng = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, engine.vocab_size, (n,), generator=rng).tolist()  # noqa: E731
    engine.reset()
    gen = Generator(engine, StubTokenizer(), GeneratorSettings(reuse=True, checkpoint_interval=8192))
    first = rand(ctx)
    request = GenerationRequest(prompt_ids=first, max_tokens=gen_tokens, message_ends=[ctx - tail],
                                sampling=SamplingParams(temperature=0.0))
    t0 = time.perf_counter()
    for _ in gen.run(request):
        pass
    first_turn_s = time.perf_counter() - t0
    times = []
    for _ in range(3):
        seconds, result = first_token_s(gen, first[:ctx - tail] + rand(tail))
        assert result.cached_tokens == ctx - tail, (result.cached_tokens, ctx - tail)
        times.append(seconds)
    if profile_to:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            first_token_s(gen, first[:ctx - tail] + rand(tail))
        table = prof.key_averages()
        Path(profile_to).write_text(table.table(sort_by="self_cuda_time_total", row_limit=25) + "\n"
                                    + table.table(sort_by="cpu_time_total", row_limit=40))
    cold = Generator(engine, StubTokenizer(), GeneratorSettings(reuse=False, checkpoint_interval=8192))
    no_reuse, result = first_token_s(cold, first[:ctx - tail] + rand(tail))
    assert result.cached_tokens == 0
    row = {"context": ctx, "fork_before_end": tail, "reuse_ms": 1e3 * min(times), "no_reuse_ms": 1e3 * no_reuse,
           "first_turn_s": first_turn_s, "checkpoint_bytes": gen.checkpoints.nbytes}
    row["no_reuse_over_reuse"] = row["no_reuse_ms"] / row["reuse_ms"]
    R["fork"].append(row)
    say(f"fork @ {ctx} - {tail}: reuse {row['reuse_ms']:.1f} ms, no reuse {row['no_reuse_ms']:.1f} ms "
        f"({row['no_reuse_over_reuse']:.1f}x)")
    engine.reset()


def checkpoint_cost(engine, device):
    """Take and restore of one checkpoint at the engine's size (device memory, no host copy)."""
    engine.reset()
    logits = engine.prefill(list(range(64)))
    take = gpu.timed(lambda: engine.take_checkpoint(logits), device, 20)
    checkpoint = engine.take_checkpoint(logits)
    restore = gpu.timed(lambda: engine.restore_checkpoint(checkpoint), device, 20)
    R["checkpoint"] = {"bytes": checkpoint.nbytes, "take_ms": take * 1e3, "restore_ms": restore * 1e3,
                       "device": str(checkpoint.logits.device)}
    say(f"checkpoint: {checkpoint.nbytes / 2 ** 20:.1f} MiB, take {take * 1e3:.3f} ms, restore {restore * 1e3:.3f} ms")
    engine.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for the JSON and markdown results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: 9b on CUDA, 0.8b elsewhere")
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--skip", default="", help="comma-separated: hf,hf-compile,hf-generate,hf-prefill,"
                        "decode,split,prefill,fork,moe-tune (the MoE step keeps triton_moe's default settings)")
    parser.add_argument("--profile-fork", help="write a torch.profiler table of one reuse fork to this file")
    parser.add_argument("--profile-step", help="write the per-kernel profile of the graph decode step at each "
                        "decode context to this markdown file (bench/hybrid_profile.py)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = args.shape or ("9b" if cuda else "0.8b")
    dtype = torch.bfloat16 if cuda else torch.float32
    skip = set(filter(None, args.skip.split(",")))
    n_decode = args.decode_tokens or (128 if cuda else 8)
    torch.set_grad_enabled(False)
    R["meta"] = meta(device, shape, args.out)
    say(json.dumps({k: v for k, v in R["meta"].items() if k != "notes"}))
    if cuda:
        section("ceilings", gpu.ceilings, device, dtype, False)

    from redlite.engine.torch_engine import TorchEngine
    from redlite.models.qwen3_5 import Qwen3_5Model

    started = time.perf_counter()
    hf = build_hf(SHAPES[shape], device, dtype)
    if SHAPES[shape].get("num_experts"):
        model = build_sharing_experts(SHAPES[shape], hf, device, dtype)
    else:
        model = Qwen3_5Model(SHAPES[shape], device=device, dtype=dtype)
        model.load_hf_weights(hf.state_dict())
    if "hf" in skip:
        del hf
        hf = None
    if cuda and SHAPES[shape].get("num_experts") and "moe-tune" not in skip:
        section("moe step tune", moe_step_tune, R, model, device)
    sizes = R["meta"]["sizes"] = model_sizes(model)
    contexts = ([1024, 8192] if "num_experts" in SHAPES[shape] else [1024, 8192, 32768]) if cuda else [256, 1024]
    fork_ctx = 32768 if cuda else 1024
    engine = TorchEngine(model, ctx_size=max(contexts + [fork_ctx]) + 1024, device=device, dtype=dtype)
    say(f"built in {time.perf_counter() - started:.1f} s: {sizes['params'] / 1e9:.2f} B parameters, "
        f"{sizes['weight_bytes_per_token'] / 1e9:.2f} GB weights read per decode token")
    section("checks", checks, hf, engine, device)
    if "decode" not in skip:
        section("decode", gpu.decode_speed, engine, sizes, contexts, n_decode, device)
    if cuda and "split" not in skip:
        section("decode split", decode_split, engine, 8192, device)
    if cuda and args.profile_step:
        section("step profile", profile_steps, engine, contexts, device, args.profile_step)
    section("checkpoint", checkpoint_cost, engine, device)
    prefill_lengths = [8192] if cuda else [512]
    if "prefill" not in skip:
        section("prefill", prefill_speed, engine, sizes, prefill_lengths, device)
    if hf is not None and "num_experts" in SHAPES[shape] and "hf-prefill" not in skip:
        section("transformers prefill", hf_prefill_speed, R, hf, engine, prefill_lengths, device)
    if "fork" not in skip:
        section("fork", fork, engine, fork_ctx, device, args.profile_fork)
    if hf is not None and "hf-generate" not in skip:
        from gpu_hf import HF_MODES

        modes = [m for m in HF_MODES if "compile" not in m or ("hf-compile" not in skip and cuda)]
        section("transformers", transformers_side_by_side, R, hf, engine, device, 1024 if cuda else 128,
                64 if cuda else 8, modes, write_results)
    write_results()
    say("\n" + markdown(R))


if __name__ == "__main__":
    main()
