"""Second-turn latency as users feel it, with reuse and with ``--no-reuse``.

Turn 1: the first 4,400 characters of bench/fixtures/long_context.txt + "Summarize the text above
in one sentence." (greedy, 32 tokens). Turn 2: turn 1 + its answer + "Which detail matters
most, and why?". A fresh server per run; TTFT = time from sending turn 2 to the first streamed
content byte. Prints a table of medians over ``--runs`` runs and saves JSON under bench/results/.

Usage: .venv/bin/python bench/ttft.py [--runs 3] [--model PATH] [--engine torch]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_process import ServerProcess  # noqa: E402

QUESTION_1 = "Summarize the text above in one sentence."
QUESTION_2 = "Which detail matters most, and why?"


def stream_ttft(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """(seconds to the first content byte, full text, usage) of one streamed chat request."""
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    pieces, usage, first = [], {}, None
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    if first is None:
                        first = time.perf_counter() - sent
                    pieces.append(content)
    return first if first is not None else float("nan"), "".join(pieces), usage


def one_run(server_args: list[str], engine: str, text: str) -> dict:
    with ServerProcess(*server_args, engine=engine, timeout_s=600) as server:
        turn1 = [{"role": "user", "content": text + "\n\n" + QUESTION_1}]
        ttft1, answer, usage1 = stream_ttft(server.url, turn1, 32)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTION_2}]
        ttft2, answer2, usage2 = stream_ttft(server.url, turn2, 32)
    return {"turn1_ttft_s": ttft1, "turn2_ttft_s": ttft2, "turn1_prompt_tokens": usage1.get("prompt_tokens"),
            "turn2_prompt_tokens": usage2.get("prompt_tokens"),
            "turn2_cached_tokens": usage2.get("prompt_tokens_details", {}).get("cached_tokens"),
            "answer1": answer, "answer2": answer2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--chars", type=int, default=4400)
    args = parser.parse_args()
    text = (ROOT / "bench" / "fixtures" / "long_context.txt").read_text(encoding="utf-8")[: args.chars]
    extra = ["--model", args.model] if args.model else []
    results = {}
    for mode, flags in (("reuse", []), ("no-reuse", ["--no-reuse"])):
        runs = []
        for i in range(args.runs):
            runs.append(one_run(extra + flags, args.engine, text))
            print(f"{mode} run {i + 1}: turn-2 TTFT {runs[-1]['turn2_ttft_s'] * 1000:.0f} ms, "
                  f"cached {runs[-1]['turn2_cached_tokens']} of {runs[-1]['turn2_prompt_tokens']}", flush=True)
        results[mode] = {"runs": runs,
                         "median_turn2_ttft_s": statistics.median(r["turn2_ttft_s"] for r in runs),
                         "median_turn1_ttft_s": statistics.median(r["turn1_ttft_s"] for r in runs)}
    reuse, cold = results["reuse"]["median_turn2_ttft_s"], results["no-reuse"]["median_turn2_ttft_s"]
    ratio = cold / reuse
    print()
    print(f"| mode     | turn-1 TTFT (ms) | turn-2 TTFT (ms) | turn-2 cached / prompt tokens |")
    print(f"|----------|------------------|------------------|-------------------------------|")
    for mode in ("reuse", "no-reuse"):
        r = results[mode]
        last = r["runs"][-1]
        print(f"| {mode:<8} | {r['median_turn1_ttft_s'] * 1000:16.0f} | {r['median_turn2_ttft_s'] * 1000:16.0f} "
              f"| {last['turn2_cached_tokens']:>13} / {last['turn2_prompt_tokens']:<13} |")
    print(f"\nturn-2 TTFT: no-reuse / reuse = {ratio:.1f}x (target >= 5x), medians of {args.runs} runs")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    path = out / f"ttft-{stamp}-{platform.machine()}-cpu.json"
    path.write_text(json.dumps({"date": stamp, "machine": platform.platform(), "chars": args.chars,
                                "ratio": ratio, **results}, indent=2))
    print(f"saved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
