"""Replicas on Ray Serve: conversation affinity against Ray Serve's own routers.

Starts a local Ray, then for each router (``affinity``: redlite's AffinityRouter; ``default``:
Ray Serve's power-of-two-choices; ``round-robin``: Ray Serve's round-robin) runs a fresh
``--replicas`` application (``redlite serve-cluster`` options, no session dir: RAM tiers only)
and sends ``--conversations`` conversations x ``--turns`` turns, interleaved (turn t of every
conversation in a seeded random order, then turn t+1: agents do not take turns in lock-step,
and a lock-step order would make round-robin sticky whenever the replicas divide the
conversations), one request at a time, streamed, through Ray Serve's HTTP proxy.
Half the conversations send a session header, half are keyless (routed on their prefix).

Per router: prompt tokens, reused tokens (``cached_tokens``), reuse efficiency = reused /
reusable over turns 2.. (reusable: what the conversation held after its previous turn: that
turn's prompt + answer tokens), TTFT sum (client side: request sent -> first content chunk) and the replicas
each conversation touched. Results: ``bench/results/replicas-DATE-MACHINE.{md,json}``.

Usage: PYTHONPATH=src .venv/bin/python bench/replicas.py [--engine echo|torch] [--replicas 3]
       [--conversations 12] [--turns 10] [--routers affinity,default,round-robin]
       [--echo-prefill-delay-ms 0.05] [--max-tokens 16] [--machine NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import socket
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from redlite.cli import build_parser  # noqa: E402

WORDS = ("replica route cache prefix state token turn agent shell patch file test build "
         "error trace review plan").split()


def user_text(conversation: int, turn: int, chars: int) -> str:
    """A deterministic user message of about ``chars`` characters."""
    words, i = [], conversation * 7 + turn * 13
    while sum(len(w) + 1 for w in words) < chars:
        words.append(WORDS[i % len(WORDS)])
        i = i * 31 + 17
    return f"conversation {conversation} turn {turn}: " + " ".join(words)


def stream_turn(client: httpx.Client, body: dict, headers: dict) -> dict:
    """One streamed chat request; returns answer text, usage, TTFT (s) and the replica."""
    sent = time.perf_counter()
    ttft, parts, usage = None, [], None
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read()[:300]!r}")
        replica = response.headers.get("x-redlite-replica")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - sent
                    parts.append(text)
            usage = chunk.get("usage") or usage
    if ttft is None:  # an empty answer: its first token is the end
        ttft = time.perf_counter() - sent
    return {"text": "".join(parts), "usage": usage, "ttft_s": ttft, "replica": replica}


def run_router(router: str, opts: argparse.Namespace, port: int) -> dict:
    """Deploy the application with ``router``, run the workload, remove it; the figures."""
    from redlite.cluster.run import APP_NAME, start_cluster
    from ray import serve

    argv = ["serve-cluster", "--engine", opts.engine, "--replicas", str(opts.replicas),
            "--router", router, "--port", str(port), "--replica-cpus", "0",
            "--max-tokens", str(opts.max_tokens), "--log-level", "warning"]
    if opts.engine == "echo":
        argv += ["--echo-prefill-delay-ms", str(opts.echo_prefill_delay_ms)]
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    start_cluster(args)
    print(f"{router}: {opts.replicas} replicas up in {time.perf_counter() - started:.1f} s",
          flush=True)
    conversations = [{"messages": [{"role": "system", "content": "You are a coding agent."}],
                      "temperature": 0, "max_tokens": opts.max_tokens}
                     for _ in range(opts.conversations)]
    headers = [{"session_id": f"bench-{c}"} if c % 2 == 0 else {}
               for c in range(opts.conversations)]
    held = [0] * opts.conversations
    totals = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "later_turn_reused_tokens": 0,
              "reusable_tokens": 0,
              "ttft_sum_s": 0.0}
    replicas = [set() for _ in conversations]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        order = random.Random(opts.seed)
        for turn in range(opts.turns):
            for c in order.sample(range(len(conversations)), len(conversations)):
                body = conversations[c]
                body["messages"].append({"role": "user",
                                         "content": user_text(c, turn, opts.user_chars)})
                result = stream_turn(client, body, headers[c])
                body["messages"].append({"role": "assistant", "content": result["text"]})
                usage = result["usage"]
                reused = usage["prompt_tokens_details"]["cached_tokens"]
                totals["requests"] += 1
                totals["prompt_tokens"] += usage["prompt_tokens"]
                totals["reused_tokens"] += reused
                if turn > 0:  # the first turn may reuse another conversation's system prompt
                    totals["later_turn_reused_tokens"] += reused
                    totals["reusable_tokens"] += held[c]
                totals["ttft_sum_s"] += result["ttft_s"]
                held[c] = usage["total_tokens"]
                replicas[c].add(result["replica"])
    serve.delete(APP_NAME)
    totals["reuse_efficiency"] = (totals["later_turn_reused_tokens"]
                                  / max(1, totals["reusable_tokens"]))
    totals["prefilled_tokens"] = totals["prompt_tokens"] - totals["reused_tokens"]
    totals["replicas_per_conversation"] = [len(r) for r in replicas]
    totals["replicas_used"] = len(set().union(*replicas))
    print(f"{router}: reuse efficiency {totals['reuse_efficiency']:.1%}, TTFT sum "
          f"{totals['ttft_sum_s']:.2f} s, prefilled {totals['prefilled_tokens']} tokens", flush=True)
    return totals


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def markdown(report: dict) -> str:
    o = report["options"]
    lines = [f"# Replicas: affinity vs Ray Serve's routers ({report['date']}, {report['machine']})",
             "",
             f"{o['replicas']} replicas ({o['engine']} engine), {o['conversations']} conversations x "
             f"{o['turns']} turns, interleaved (seeded random order per round), one request at a time, streamed through Ray "
             f"Serve's HTTP proxy; half with a session header, half keyless. max_tokens "
             f"{o['max_tokens']}, user messages ~{o['user_chars']} chars"
             + (f", echo prefill delay {o['echo_prefill_delay_ms']} ms/token" if o['engine'] == 'echo' else "")
             + f". Load average at the start {report['loadavg'][0]:.1f} on "
             f"{report['cpus']} CPUs (timings are noisy when it is high).",
             "",
             "| router | requests | prompt tok | reused tok | prefilled tok | reuse efficiency "
             "| TTFT sum (s) | replicas per conversation (max) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in report["routers"].items():
        lines.append(f"| {name} | {r['requests']} | {r['prompt_tokens']} | {r['reused_tokens']} | "
                     f"{r['prefilled_tokens']} | {r['reuse_efficiency']:.1%} | {r['ttft_sum_s']:.2f} "
                     f"| {max(r['replicas_per_conversation'])} |")
    lines += ["", "reuse efficiency = reused tokens / tokens held after each conversation's "
              "previous turn, over turns 2 and later (what a perfect router could reuse; "
              "the first turns reuse only a shared system prompt).", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["echo", "torch"], default="echo")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--routers", default="affinity,default,round-robin")
    parser.add_argument("--user-chars", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--echo-prefill-delay-ms", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0, help="the order of turns within a round")
    parser.add_argument("--machine", default=f"{platform.machine()}-cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = parser.parse_args()

    import ray

    ray.init(num_cpus=max(2, opts.replicas), include_dashboard=False, log_to_driver=False)
    report = {"date": datetime.date.today().isoformat(), "machine": opts.machine,
              "options": vars(opts), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
              "routers": {}}
    try:
        port = free_port()
        for router in opts.routers.split(","):
            report["routers"][router] = run_router(router, opts, port)
    finally:
        from ray import serve
        serve.shutdown()
        ray.shutdown()
    text = markdown(report)
    print(text)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"replicas-{report['date']}-{opts.machine}-{opts.engine}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"saved {out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
