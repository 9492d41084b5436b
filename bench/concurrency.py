"""Several conversations at once through the HTTP server (``--parallel``), issue 20's figures.

One server (``redlite serve --parallel P``, P = the most streams asked for) answers, in order:

1. aggregate decode: for each S in ``--streams``, S streamed greedy requests at once (distinct
   story prompts, ``--max-tokens`` each). Client-side stamps of every content chunk; the
   *window* runs from the last stream's first token to the first stream's last token (all S
   decoding), and aggregate tok/s = chunks inside it / its length. Per stream, the same count
   of its own chunks in the window: its decode rate while S run. Ratios against S = 1. Beside
   it, every chunk over the time from the first stream's first chunk to the last one's last.
2. second-turn TTFT of a main conversation (turn 1: ``--context`` tokens' worth of
   bench/fixtures/long_context.txt + a question; turn 2: + answer + a follow-up), alone and
   while a sub-agent (another conversation) streams: the follow-up is sent once the
   sub-agent's first token has arrived. Each repetition uses a fresh main conversation
   (its own first line) so turn 1 is never reused from an earlier repetition.

Prints a Markdown table and writes ``bench/results/concurrent-DATE-MACHINE.{md,json}``.

Usage (CPU, bundled model): PYTHONPATH=src .venv/bin/python bench/concurrency.py
  [--streams 1,2,4,8] [--max-tokens 64] [--context 1000] [--repeat 3] [--model PATH]
  [--device cpu|cuda] [--dtype bfloat16] [--ctx-size N] [--server-arg=--flag ...]
  [--engine torch|echo] [--machine NAME] [--out DIR]
GPU, 8B shape (the lead): --shape 8b --device cuda --dtype bfloat16 --streams 1,8,32
  --max-tokens 256 --ctx-size 4096 --machine nvidia-h200 (random weights, bundled tokenizer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_process import ServerProcess  # noqa: E402

TOPICS = ["a lighthouse keeper", "a lost robot", "a dragon who bakes bread", "two rival chefs",
          "a river that talks", "a clockmaker's apprentice", "a ship in the ice", "a fox and a crow"]


def story(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Story {i}: write a long, detailed story about {topic}."}]


def stream(url: str, messages: list[dict], max_tokens: int, first_token: threading.Event | None = None) -> dict:
    """One streamed greedy chat request: perf_counter stamps of its content chunks, text, usage."""
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    stamps, pieces, usage = [], [], {}
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text = choice["delta"].get("content")
                if text:
                    stamps.append(time.perf_counter())
                    pieces.append(text)
                    if first_token is not None:
                        first_token.set()
            usage = chunk.get("usage") or usage
    return {"sent": sent, "stamps": stamps, "text": "".join(pieces), "usage": usage}


def at_once(jobs: list) -> list:
    """Run the callables in threads at once; their results in order."""
    results: list = [None] * len(jobs)

    def run(i: int) -> None:
        results[i] = jobs[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def decode_round(url: str, streams: int, max_tokens: int, offset: int) -> dict:
    runs = at_once([lambda i=i: stream(url, story(offset + i), max_tokens) for i in range(streams)])
    runs = [r for r in runs if len(r["stamps"]) > 1]
    start = max(r["stamps"][0] for r in runs)
    stop = min(r["stamps"][-1] for r in runs)
    span = stop - start
    inside = [sum(start < s <= stop for s in r["stamps"]) for r in runs]
    whole = max(r["stamps"][-1] for r in runs) - min(r["stamps"][0] for r in runs)
    return {"streams": streams, "window_s": span,
            "overall_tok_s": sum(len(r["stamps"]) for r in runs) / whole if whole > 0 else None,
            "aggregate_tok_s": sum(inside) / span if span > 0 else None,
            "per_stream_tok_s": [n / span for n in inside] if span > 0 else None,
            "completion_tokens": [r["usage"].get("completion_tokens") for r in runs]}


def context_text(tokens: int) -> str:
    text = (ROOT / "bench/fixtures/long_context.txt").read_text()
    return text[:tokens * 4]  # ~4 characters per token for English prose


def ttft_round(url: str, context: str, rep: int, with_sub: bool, max_tokens: int) -> dict:
    main = [{"role": "user", "content": f"Conversation {rep}{'s' if with_sub else 'a'}.\n{context}\n"
             "Summarize the text above in one sentence."}]
    first = stream(url, main, 32)
    main += [{"role": "assistant", "content": first["text"]},
             {"role": "user", "content": "Which detail matters most, and why?"}]
    sub_thread, sub_first = None, threading.Event()
    if with_sub:
        sub_thread = threading.Thread(target=stream, args=(url, story(100 + rep), max_tokens, sub_first))
        sub_thread.start()
        sub_first.wait(600)
    second = stream(url, main, 16)
    if sub_thread is not None:
        sub_thread.join()
    return {"ttft_ms": 1e3 * (second["stamps"][0] - second["sent"]),
            "cached_tokens": (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
            "prompt_tokens": second["usage"].get("prompt_tokens")}


def random_model(shape: str, ctx: int, tokenizer_dir: str | None = None) -> Path:
    """A Hugging Face directory of ``shape`` with random weights and the tokenizer of
    ``tokenizer_dir`` (default: the bundled model's), as bench/serve_gpu.py's ``build_dir``
    writes it, in a temporary directory."""
    import tempfile

    import importlib.util

    sys.path.insert(0, str(ROOT / "src"))
    spec = importlib.util.spec_from_file_location("serve_gpu", ROOT / "bench/serve_gpu.py")
    serve_gpu = importlib.util.module_from_spec(spec)  # torch is needed only here
    spec.loader.exec_module(serve_gpu)
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer

    tok_dir = Path(tokenizer_dir) if tokenizer_dir else Path(resolve_model_dir(bundled_model_path()))
    tokenizer = load_tokenizer(tok_dir)
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="concurrent-"))
    model_dir, model = serve_gpu.build_dir(shape, tok_dir, work, tokenizer.eos_token_ids, vocab, ctx)
    del model
    return model_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000, help="main conversation's turn-1 tokens (approx.)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--model")
    parser.add_argument("--shape", help="random bf16 weights of a bench/serve_gpu.py shape (8b, 1b, "
                        "tiny; end-of-turn rows 0, so answers run to --max-tokens) instead of --model")
    parser.add_argument("--tokenizer", help="with --shape: a directory with tokenizer.json and "
                        "config.json (default: the bundled model's)")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--server-arg", action="append", default=[])
    parser.add_argument("--machine", default=platform.node() or "machine")
    parser.add_argument("--out", default=str(ROOT / "bench/results"))
    args = parser.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    if args.shape:
        args.model = str(random_model(args.shape, args.ctx_size, args.tokenizer))
    flags = ["--parallel", str(max(counts)), "--ctx-size", str(args.ctx_size), "--queue", "64",
             *args.server_arg]
    for name in ("model", "device", "dtype"):
        if getattr(args, name):
            flags += [f"--{name}", getattr(args, name)]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": args.machine, "flags": flags, "max_tokens": args.max_tokens,
              "decode": [], "ttft": {"alone": [], "with_sub_agent": []},
              "load_before": os.getloadavg()}
    with ServerProcess(*flags, engine=args.engine, timeout_s=1800) as server:
        stream(server.url, story(999), 8)  # warm the server's first-request paths
        for rep in range(args.repeat):
            for s in counts:
                result["decode"].append(decode_round(server.url, s, args.max_tokens, 10 * rep))
        context = context_text(args.context)
        for rep in range(args.repeat):
            result["ttft"]["alone"].append(ttft_round(server.url, context, rep, False, args.max_tokens))
            result["ttft"]["with_sub_agent"].append(ttft_round(server.url, context, rep, True,
                                                               args.max_tokens))
        lines = server.log().splitlines()
        result["log_tail"] = lines[-20:]
        result["log_problems"] = [line for line in lines if " WARNING " in line or " ERROR " in line
                                  or "Traceback" in line][:40]
        result["log_batches"] = [line for line in lines if "decode batches" in line][-40:]
        result["log_warmup"] = [line for line in lines if "warm-up" in line]
    result["load_after"] = os.getloadavg()
    write(result, counts, Path(args.out))
    return 0


def write(result: dict, counts: list[int], out: Path) -> None:
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")

    rows = {s: [r for r in result["decode"] if r["streams"] == s] for s in counts}
    aggregate = {s: median(r["aggregate_tok_s"] for r in rows[s]) for s in counts}
    per_stream = {s: median(statistics.mean(r["per_stream_tok_s"]) for r in rows[s]
                            if r["per_stream_tok_s"]) for s in counts}
    overall = {s: median(r["overall_tok_s"] for r in rows[s]) for s in counts}
    alone = aggregate[counts[0]] if counts[0] == 1 else float("nan")
    lines = [f"# concurrent decode ({result['machine']}, {result['date']})", "",
             f"server flags: `{' '.join(result['flags'])}`; {result['max_tokens']} tokens per stream; "
             f"medians of {len(rows[counts[0]])} rounds; load average (1/5/15 min) before "
             f"{'/'.join(f'{x:.1f}' for x in result['load_before'])}, after "
             f"{'/'.join(f'{x:.1f}' for x in result['load_after'])}", "",
             "| streams | aggregate tok/s | x one stream | one stream's tok/s | % of alone | "
             "first to last token, all streams: tok/s |",
             "|---|---|---|---|---|---|"]
    for s in counts:
        lines.append(f"| {s} | {aggregate[s]:.1f} | {aggregate[s] / alone:.2f} | {per_stream[s]:.1f} | "
                     f"{100 * per_stream[s] / alone:.0f}% | {overall[s]:.1f} |")
    ttft_alone = median(r["ttft_ms"] for r in result["ttft"]["alone"])
    ttft_sub = median(r["ttft_ms"] for r in result["ttft"]["with_sub_agent"])
    cached = [r["cached_tokens"] for r in result["ttft"]["alone"] + result["ttft"]["with_sub_agent"]]
    lines += ["", "| main conversation, second turn | TTFT ms | ratio |", "|---|---|---|",
              f"| alone | {ttft_alone:.0f} | 1.00 |",
              f"| while a sub-agent streams | {ttft_sub:.0f} | {ttft_sub / ttft_alone:.2f} |", "",
              f"second turns' cached tokens: {cached}"]
    result["summary"] = {"aggregate_tok_s": aggregate, "per_stream_tok_s": per_stream,
                         "ttft_alone_ms": ttft_alone, "ttft_with_sub_agent_ms": ttft_sub}
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"concurrent-{result['date'][:10]}-{result['machine']}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
