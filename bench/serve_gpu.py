"""The GPU as a user meets it: ``redlite serve --device cuda`` driven over HTTP with streamed
chat requests, beside the engine-level figures (bench/gpu.py's decode loop) of the same
weights, measured in the same run.

Usage (on a CUDA machine)::

    PYTHONPATH=src python3 bench/serve_gpu.py --tokenizer DIR --out bench/results
    PYTHONPATH=src python3 bench/serve_gpu.py --tokenizer DIR --shapes 1b --held 1024

``--tokenizer``: a directory with ``tokenizer.json`` (default: the bundled SmolLM2 model's
converted directory); the models use its vocabulary (49,152 for SmolLM2). Shapes, random
bfloat16 weights written as a Hugging Face directory: ``1b`` = Llama-3.2-1B's (hidden 2048, 16
layers, 32/8 heads of 64, intermediate 8192, tied; 1.07 B parameters with this vocabulary),
``8b`` = Qwen3-8B's (hidden 4096, 36 layers, 32/8 heads of 128, q/k norm, intermediate 12288);
``hybrid9b`` = the Qwen3.5-9B shape of bench/hybrid_report.py (Gated DeltaNet + gated
attention; its recurrent state is copied aside at every pipelined step, for the undo). The
end-of-turn ids' output rows are zero, so greedy answers run to ``max_tokens``.

Per shape, one fresh server (its start-up log gives the warm-up and cold-start seconds), then:

1. decode: four new conversations of ``--prompt`` tokens, ``--decode`` greedy tokens each; the
   first request's decode rate vs the later ones' median (server log rate; the client's rate
   from its first to its last streamed chunk beside it); one sampled request (temperature 0.8,
   top-p 0.95, top-k 50).
2. TTFT per held size H (``--held``): a new conversation of H tokens (answer 32 tokens), then
   ``--rounds`` rounds of its regenerate (same messages again: rewind, prefill 1 token; from the
   second round on it forks the conversation the last second turn extended) and a second turn
   (that answer + a user message, another one each round). TTFT = time to the first streamed
   content chunk (client), against the ideal: the engine's prefill of the same new tokens on H
   held tokens + reading the first sampled id; the table gives medians over the rounds. Then,
   per round, an extension: the second turn's answer + a short user message (nothing rewound).
   The cases: a regenerate is a fork by rewind (its old answer's tail
   parked); a second turn from the second round on is a fork back to the earlier round's branch
   (its parked tail restored, then a rewind to where the new message starts; in the first round
   it extends the live state); an extension only prefills its new tokens. The JSON carries per
   held size ``fork_excess_ms`` (regenerates), ``second_turn_excess_ms`` and
   ``extension_excess_ms`` (medians), and each round's.
3. engine level, after the server has stopped, same weights: bench/gpu.py's decode loop (greedy
   id read on the host every step) at the decode requests' context; bound = measured copy
   bandwidth / (weight bytes + KV bytes at the mean context) per token.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
import gpu  # noqa: E402  (bench/gpu.py: ceilings, decode_rate, model_sizes)
from server_process import ServerProcess  # noqa: E402

SHAPES = {
    "1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500000.0, architectures=["LlamaForCausalLM"]),
    "8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_theta=1000000.0, architectures=["Qwen3ForCausalLM"]),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # smoke test
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 rope_theta=10000.0, architectures=["LlamaForCausalLM"]),
}
HYBRID = {"hybrid9b": "9b", "hybrid-tiny": "tiny"}  # Qwen3.5 shapes of bench/hybrid_report.py
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
R: dict = {"meta": {}, "shapes": {}, "errors": []}


def say(*parts) -> None:
    print(*parts, flush=True)


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face weight names -> shapes of a llama/qwen3 config."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter)})
        if cfg["model_type"] == "qwen3":
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


def build_dir(shape: str, tok_dir: Path, work: Path, eos: frozenset[int], vocab: int, max_pos: int):
    """(model directory, the same model in this process) with random bf16 weights (std 0.02,
    norms 1 (llama) or near their usual ranges (hybrid), end-of-turn output rows 0)."""
    import shutil

    from safetensors.torch import save_file

    if shape in HYBRID:
        cfg, model = hybrid_model(shape, vocab, max_pos, eos)
        tensors = {"model." + name: t for name, t in model.hf_targets().items()}
    else:
        cfg, tensors = llama_tensors(shape, vocab, max_pos, eos)
        from redlite.models.llama import LlamaModel
        model = LlamaModel(cfg, device=DEVICE, dtype=torch.bfloat16)
        model.load_hf_weights(tensors)
    out = work / shape
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / "model.safetensors"))
    del tensors
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / name)
    return out, model.eval()


def llama_tensors(shape: str, vocab: int, max_pos: int, eos) -> tuple[dict, dict]:
    cfg = dict(SHAPES[shape], vocab_size=vocab, rms_norm_eps=1e-6, hidden_act="silu",
               max_position_embeddings=max_pos, torch_dtype="bfloat16", eos_token_id=sorted(eos))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    tensors = {}
    for name, dims in hf_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=torch.bfloat16, device=DEVICE)
        else:
            t = (torch.randn(dims, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16)
        if name == ("model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"):
            t[sorted(eos)] = 0
        tensors[name] = t
    return cfg, tensors


def hybrid_model(shape: str, vocab: int, max_pos: int, eos):
    """A Qwen3.5 model (bench/hybrid_report.py's shapes) with random weights on the device."""
    from hybrid_report import SHAPES as HYBRID_SHAPES, random_weights

    from redlite.models.qwen3_5 import Qwen3_5Model

    cfg = dict(HYBRID_SHAPES[HYBRID[shape]], vocab_size=vocab, max_position_embeddings=max_pos,
               torch_dtype="bfloat16", eos_token_id=sorted(eos))
    model = random_weights(Qwen3_5Model(cfg, device=DEVICE, dtype=torch.bfloat16))
    with torch.no_grad():
        model.lm_head_weight[sorted(eos)] = 0
    return cfg, model


def words(n_tokens: int, seed: int) -> str:
    """Text of about ``n_tokens`` tokens (distinct per seed)."""
    import random

    rng = random.Random(seed)
    vocab = ["alpha", "river", "stone", "quiet", "number", "light", "garden", "ship", "window", "orbit"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(int(n_tokens / 2.9)))


def chat(client: httpx.Client, messages: list[dict], max_tokens: int, **sampling) -> dict:
    """One streamed chat request over ``client`` (one per server, kept open as an SDK's is:
    making an httpx client costs tens of ms, which a TTFT must not count): client TTFT (from
    handing httpx the JSON body, encoded before: ``encode_ms``, the client's own work, is not
    in it) to the first content chunk, client decode rate, text, usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, **sampling}
    pieces, usage, stamps = [], {}, []
    encoding = time.perf_counter()
    raw = json.dumps(body, ensure_ascii=False).encode()
    sent = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "choices" not in chunk:
                raise RuntimeError(f"error chunk from the server: {chunk}")
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    stamps.append(time.perf_counter() - sent)
                    pieces.append(choice["delta"]["content"])
    n = usage.get("completion_tokens", 0)
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"ttft_ms": 1e3 * stamps[0] if stamps else float("nan"), "text": "".join(pieces),
            "encode_ms": 1e3 * (sent - encoding),
            "completion_tokens": n, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "client_decode_tok_s": (len(stamps) - 1) / span if span > 0 else None}


def log_rates(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"generated \d+ tok, decode ([\d.]+) tok/s", log)]


def serve(model_dir: Path, args, ctx: int) -> dict:
    """Section 1 and 2 through one server."""
    out: dict = {"decode": [], "ttft": []}
    flags = ["--model", str(model_dir), "--device", DEVICE.type, "--dtype", "bfloat16", "--ctx-size", str(ctx),
             "--max-tokens", "8192"]
    started = time.perf_counter()
    with ServerProcess(*flags, engine="torch", timeout_s=900) as server:
        try:
            _requests(server, args, out, started)
        except Exception:
            say("server log tail:\n" + "\n".join(server.log().splitlines()[-40:]))
            raise
        log = server.log()
    rates = log_rates(log)
    for res, rate in zip(out["decode"], rates):
        res["server_decode_tok_s"] = rate
    out["sampled"]["server_decode_tok_s"] = rates[4] if len(rates) > 4 else None
    warm = re.search(r"warm-up done in ([\d.]+) s: (\d+) CUDA graphs \(decode path (\S+)\)", log)
    cold = re.search(r"cold start ([\d.]+) s", log)
    out.update(warmup_s=float(warm.group(1)) if warm else None, graphs=int(warm.group(2)) if warm else None,
               decode_path=warm.group(3) if warm else None, cold_start_s=float(cold.group(1)) if cold else None)
    out["log_tail"] = log.splitlines()[-40:]
    if args.server_log:
        Path(args.server_log).mkdir(parents=True, exist_ok=True)
        (Path(args.server_log) / f"server-{model_dir.name}.log").write_text(log)
    return out


def _requests(server, args, out: dict, started: float) -> None:
    out["ready_s"] = time.perf_counter() - started
    with httpx.Client(base_url=server.url, timeout=900) as client:
        _chats(client, args, out, server)


def server_ttft_ms(log: str) -> float | None:
    """The newest request's TTFT as the server's generator logged it (from choosing the
    conversation to the first token: no HTTP, template or tokenizer time)."""
    found = re.findall(r"prefill \d+ tok \(\d+ cached\) ttft ([\d.]+) ms", log)
    return float(found[-1]) if found else None


QUESTIONS = ["Which detail matters most, and why?", "Reader: what stands out here, briefly?",
             "Now list the two strongest points.", "Honestly, what would you change first?",
             "Summarize the middle part in one line.", "Consider the ending: does it hold up?",
             "Explain the first claim to a newcomer.", "Given all this, what comes next?"]


FOLLOW_UPS = ["Go on.", "And then?", "Say more about that.", "Why so?", "Give an example.",
              "Keep going.", "What else?", "Be more specific."]


def _chats(client: httpx.Client, args, out: dict, server) -> None:
    for i in range(4):
        res = chat(client, [{"role": "user", "content": words(args.prompt, seed=i)}], args.decode)
        out["decode"].append(res)
    out["sampled"] = chat(client, [{"role": "user", "content": words(args.prompt, seed=9)}], args.decode,
                          temperature=0.8, top_p=0.95, top_k=50, seed=1)
    for held in args.held:
        first = [{"role": "user", "content": words(held, seed=100 + held)}]
        new = chat(client, first, 32)
        new["server_ttft_ms"] = server_ttft_ms(server.log())
        cases = [("new conversation", new, 0)]
        for r in range(args.rounds):  # a regenerate forks the conversation the last turn extended
            regen = chat(client, first, 8)
            regen["server_ttft_ms"] = server_ttft_ms(server.log())
            turn2 = first + [{"role": "assistant", "content": regen["text"]},
                             {"role": "user", "content": QUESTIONS[r % len(QUESTIONS)]}]
            second = chat(client, turn2, 8)
            second["server_ttft_ms"] = server_ttft_ms(server.log())
            turn3 = turn2 + [{"role": "assistant", "content": second["text"]},
                             {"role": "user", "content": FOLLOW_UPS[r % len(FOLLOW_UPS)]}]
            third = chat(client, turn3, 8)
            third["server_ttft_ms"] = server_ttft_ms(server.log())
            cases += [("regenerate", regen, r), ("second turn", second, r), ("extension", third, r)]
        for case, res, r in cases:
            out["ttft"].append({"held": held, "case": case, "round": r, "prompt_tokens": res["prompt_tokens"],
                                "cached_tokens": res["cached_tokens"], "ttft_ms": res["ttft_ms"],
                                "encode_ms": res["encode_ms"],
                                "server_ttft_ms": res["server_ttft_ms"]})


def engine_level(model, ctx: int, served: dict, args) -> dict:
    """Section 3 and the TTFT ideals, on the same weights (``model`` in this process)."""
    from redlite.engine.torch_engine import TorchEngine

    device = DEVICE
    if hasattr(model, "spec"):
        sizes = gpu.model_sizes(model)
    else:
        from hybrid_report import model_sizes
        sizes = model_sizes(model)
    from redlite.engine.warmup import warm_up

    engine = TorchEngine(model, ctx_size=ctx, device=device, dtype=torch.bfloat16)
    warm_up(engine)  # as the server's start-up: graphs, and graph_prefill_tokens measured
    context = served["decode"][0]["prompt_tokens"]
    rate = gpu.decode_rate(engine, context, args.decode, device)
    bw = gpu.R["ceilings"]["copy_bw_Bps"]
    per_token = sizes["weight_bytes_per_token"] + sizes["kv_bytes_per_token"] * (context + args.decode / 2) \
        + sizes.get("state_bytes_per_token", 0)
    logits = engine.prefill([5])
    ideals: dict[tuple[int, int], float] = {}
    for row in served["ttft"]:
        if row["case"] == "new conversation" or row["cached_tokens"] is None:
            continue
        held, new = row["cached_tokens"], row["prompt_tokens"] - row["cached_tokens"]
        if (held, new) not in ideals:
            times = []
            for _ in range(3):
                engine.reset()
                engine.state.n_past = held  # random KV rows are as good as real ones for timing
                gpu.sync(device)
                t0 = time.perf_counter()
                # no new token: a hybrid's checkpoint at the prompt's end holds the logits there
                int(torch.argmax(engine.prefill(list(range(5, 5 + new))) if new else logits))
                times.append(time.perf_counter() - t0)
            ideals[held, new] = 1e3 * min(times)
        row["ideal_ms"] = ideals[held, new]
        row["excess_ms"] = row["ttft_ms"] - row["ideal_ms"]
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"context": context, "tok_s": rate, "bound_tok_s": bw / per_token, "sizes": sizes}


def run_shape(shape: str, args, tok_dir: Path, eos, vocab: int, work: Path) -> None:
    ctx = 2 * max(args.held) + 4096
    t0 = time.perf_counter()
    model_dir, model = build_dir(shape, tok_dir, work, eos, vocab, ctx)
    say(f"[{shape}] random weights written in {time.perf_counter() - t0:.1f} s")
    served = serve(model_dir, args, ctx)
    eng = engine_level(model, ctx, served, args)
    del model
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    first = served["decode"][0]["server_decode_tok_s"]
    later = statistics.median(r["server_decode_tok_s"] for r in served["decode"][1:])
    ttft = {f"{r['held']}/{r['case']}/{r['round']}": r for r in served["ttft"]}
    R["shapes"][shape] = {
        "params": eng["sizes"]["params"], "engine": eng, "served": served,
        "first_request_decode_tok_s": first, "later_decode_tok_s": later,
        "server_to_engine_decode": later / eng["tok_s"], "first_to_later_decode": first / later,
        "pct_of_bound": 100 * later / eng["bound_tok_s"], "warmup_s": served["warmup_s"],
        "fork_excess_ms": excess_medians(served["ttft"], "regenerate"),
        "second_turn_excess_ms": excess_medians(served["ttft"], "second turn"),
        "fork_excess_ms_rounds": excess_rounds(served["ttft"], "regenerate"),
        "second_turn_excess_ms_rounds": excess_rounds(served["ttft"], "second turn"),
        "extension_excess_ms": excess_medians(served["ttft"], "extension"),
        "extension_excess_ms_rounds": excess_rounds(served["ttft"], "extension"),
        "ttft": ttft,
    }
    s = R["shapes"][shape]
    say(f"[{shape}] decode served first {first:.1f} / later {later:.1f} tok/s; engine {eng['tok_s']:.1f} "
        f"({100 * s['server_to_engine_decode']:.1f}% of engine, {s['pct_of_bound']:.1f}% of bound "
        f"{eng['bound_tok_s']:.0f}); warm-up {served['warmup_s']} s")


def excess_rounds(rows: list[dict], case: str) -> dict[str, list[float]]:
    """Per held size (str), the excess of each round of ``case``, in order."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if r["case"] == case and r.get("excess_ms") is not None:
            out.setdefault(str(r["held"]), []).append(r["excess_ms"])
    return out


def excess_medians(rows: list[dict], case: str) -> dict[str, float]:
    """Per held size (str), the median excess over the rounds of ``case``."""
    return {held: statistics.median(xs) for held, xs in excess_rounds(rows, case).items()}


def ttft_summary(rows: list[dict]) -> list[dict]:
    """One row per (held, case): medians over the rounds, with the rounds' range."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["held"], r["case"]), []).append(r)

    def med(items, key):
        xs = [x[key] for x in items if x.get(key) is not None]
        return statistics.median(xs) if xs else None
    out = []
    for (held, case), items in groups.items():
        excess = [x["excess_ms"] for x in items if x.get("excess_ms") is not None]
        out.append({"held": held, "case": case, "n": len(items), "prompt_tokens": items[0]["prompt_tokens"],
                    "cached_tokens": items[0]["cached_tokens"], "ttft_ms": med(items, "ttft_ms"),
                    "server_ttft_ms": med(items, "server_ttft_ms"), "ideal_ms": med(items, "ideal_ms"),
                    "encode_ms": med(items, "encode_ms"),
                    "excess_ms": statistics.median(excess) if excess else None,
                    "excess_range": (min(excess), max(excess)) if excess else None})
    return out


def markdown() -> str:
    m = R["meta"]
    lines = [f"# Served GPU figures, {m['date']}, {m['device']}", "",
             f"Command: `{m['command']}`", "", f"Versions: {m['versions']}; copy bandwidth "
             f"{m.get('copy_bw_TBps', 0):.3f} TB/s. Random bf16 weights, vocabulary {m['vocab']}.", "",
             "| shape | warm-up s | decode served, 1st request | served, later (median) | engine (bench/gpu.py loop) "
             "| served / engine | % of bound | sampled, served |", "|---|---|---|---|---|---|---|---|"]
    for name, s in R["shapes"].items():
        e = s["engine"]
        lines.append(f"| {name} ({s['params'] / 1e9:.2f} B) | {s['warmup_s']} | {s['first_request_decode_tok_s']:.1f} "
                     f"| {s['later_decode_tok_s']:.1f} | {e['tok_s']:.1f} @ {e['context']} | "
                     f"{100 * s['server_to_engine_decode']:.1f}% | {s['pct_of_bound']:.1f}% of {e['bound_tok_s']:.0f} | "
                     f"{s['served']['sampled'].get('server_decode_tok_s') or 0:.1f} |")
    lines += ["", "| shape | held | case | rounds | prompt tok | cached | client's JSON encoding ms "
              "| TTFT ms (client) | server's TTFT ms | ideal ms | excess ms | excess range |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f1(x):
        return "" if x is None else f"{x:.1f}"
    for name, s in R["shapes"].items():
        for r in ttft_summary(s["served"]["ttft"]):
            spread = f"{r['excess_range'][0]:.1f} - {r['excess_range'][1]:.1f}" if r["excess_range"] else ""
            lines.append(f"| {name} | {r['held']} | {r['case']} | {r['n']} | {r['prompt_tokens']} | "
                         f"{r['cached_tokens']} | {f1(r['encode_ms'])} | {f1(r['ttft_ms'])} | {f1(r['server_ttft_ms'])} | "
                         f"{f1(r['ideal_ms'])} | {f1(r['excess_ms'])} | {spread} |")
    lines += ["", "Notes:", "",
              "- Served decode: the server log's rate per request (generator: tokens after the first / time); "
              "engine: bench/gpu.py's greedy loop reading each id on the host, at the requests' context.",
              "- Ideal TTFT: the engine's prefill of the request's uncached tokens on that many held "
              "(random) KV rows + reading the first sampled id; client TTFT, from handing httpx the "
              "request's JSON bytes (encoded before the clock starts: the client's own work, in its "
              "column) to the first content chunk, includes HTTP, templating, tokenizing, planning "
              "and the first chunk's trip back."]
    if R["errors"]:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in R["errors"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--tokenizer", default=None, help="directory with tokenizer.json")
    parser.add_argument("--held", default="1024,8192,32768", help="held sizes for the TTFT cases, tokens")
    parser.add_argument("--prompt", type=int, default=1024, help="decode requests' prompt, tokens")
    parser.add_argument("--decode", type=int, default=256, help="tokens per decode request")
    parser.add_argument("--rounds", type=int, default=5,
                        help="regenerate + second turn rounds per held size (medians reported)")
    parser.add_argument("--out", default=None, help="folder for serve_gpu-DATE-MACHINE.{md,json}")
    parser.add_argument("--server-log", default=None, help="folder for each server's whole log")
    parser.add_argument("--workdir", default=None, help="where the model directories go (default: a temp dir)")
    args = parser.parse_args()
    args.held = [int(x) for x in args.held.split(",") if x]
    from redlite.loading.tokenizer import load_tokenizer

    if args.tokenizer:
        tok_dir = Path(args.tokenizer)
    else:
        from redlite.loading.bundled import bundled_model_path
        from redlite.loading.gguf import resolve_model_dir
        tok_dir = Path(resolve_model_dir(bundled_model_path()))
    tokenizer = load_tokenizer(tok_dir)
    config = tok_dir / "config.json"
    vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else len(tokenizer.tokenizer)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    R["meta"] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "device": name,
                 "command": "PYTHONPATH=src python3 bench/serve_gpu.py " + " ".join(sys.argv[1:]),
                 "versions": {"torch": torch.__version__, "cuda": torch.version.cuda}, "vocab": vocab}
    gpu.ceilings(DEVICE, torch.bfloat16, True)
    R["meta"]["copy_bw_TBps"] = gpu.R["ceilings"]["copy_bw_Bps"] / 1e12
    work = Path(args.workdir or tempfile.mkdtemp(prefix="serve_gpu-"))
    for shape in filter(None, args.shapes.split(",")):
        try:
            run_shape(shape, args, tok_dir, tokenizer.eos_token_ids, vocab, work)
        except Exception as error:  # noqa: BLE001 - report and go on with the next shape
            import traceback
            traceback.print_exc()
            R["errors"].append(f"{shape}: {type(error).__name__}: {error}")
        write(args.out)
    say("\n" + markdown())


def write(out: str | None) -> None:
    if not out:
        return
    machine = re.sub(r"[^a-z0-9]+", "-", R["meta"]["device"].lower()).strip("-").removeprefix("nvidia-")
    stem = Path(out) / f"serve_gpu-{R['meta']['date']}-nvidia-{machine}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown())


if __name__ == "__main__":
    main()
