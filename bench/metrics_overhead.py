"""Decode speed through the server with and without metrics (issue 21: on by default if it
costs < 1% of decode time).

One server at a time (two side by side on a small machine slow one of them whatever the
setting): phases of ``--metrics`` and ``--no-metrics`` servers alternate (AB BA AB ..., so drift
in the machine's load hits both), the same greedy completion requests in each, a scrape of
``/metrics`` every 5 requests. Printed: generated tokens per second of each and the overhead
in percent; the per-request cost of the metrics (observe + one scrape) is a few tens of
microseconds whatever the model, so the echo engine (no model time at all) is the worst case.

    python bench/metrics_overhead.py [--engine torch|echo] [--rounds 20] [--max-tokens 64]
        [--out bench/results]   # also writes metrics-overhead-DATE-MACHINE-ENGINE.{md,json}
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_process import ServerProcess  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def connect(url: str) -> http.client.HTTPConnection:
    """A keep-alive connection; http.client sets TCP_NODELAY and sends a small request in one
    write (httpx's separate header and body writes can meet the server's delayed ACK: 40 ms
    stalls that come and go per connection and would swamp the figure)."""
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)


def get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    response = conn.getresponse()
    body = response.read()
    assert response.status == 200, (path, response.status)
    return body


def one(conn: http.client.HTTPConnection, max_tokens: int, i: int) -> tuple[float, int]:
    body = json.dumps({"prompt": f"{PROMPT} ({i})", "max_tokens": max_tokens, "temperature": 0})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body.encode(),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    elapsed = time.perf_counter() - started
    assert response.status == 200, data
    return elapsed, json.loads(data)["usage"]["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="echo", choices=["echo", "torch"])
    parser.add_argument("--rounds", type=int, default=20, help="requests per phase")
    parser.add_argument("--phases", type=int, default=4,
                        help="server runs per setting, alternating (ABBA...)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for both servers (e.g. --device=cuda)")
    parser.add_argument("--out", type=Path, help="folder for the md + json result files")
    args = parser.parse_args()
    totals = {"metrics": [0.0, 0], "no-metrics": [0.0, 0]}
    for phase in range(args.phases):
        for name in (("metrics", "no-metrics") if phase % 2 == 0 else ("no-metrics", "metrics")):
            with ServerProcess(f"--{name}", *args.server_arg, engine=args.engine,
                               timeout_s=600) as server:
                conn = connect(server.url)
                one(conn, args.max_tokens, -1)  # warm-up: first-request costs out of the figure
                for i in range(args.rounds):
                    seconds, tokens = one(conn, args.max_tokens, i)
                    totals[name][0] += seconds
                    totals[name][1] += tokens
                    if name == "metrics" and i % 5 == 4:
                        get(conn, "/metrics")  # a scrape every 5 requests (not timed)
                conn.close()
    rates = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    lines = []
    for name, (seconds, tokens) in totals.items():
        lines.append(f"{name:>11}: {tokens} tokens in {seconds:.3f} s = {rates[name]:.1f} tok/s "
                     f"({args.engine}, {args.phases * args.rounds // 2} requests of up to "
                     f"{args.max_tokens} tokens)")
    overhead = (rates["no-metrics"] - rates["metrics"]) / rates["no-metrics"] * 100.0
    lines.append(f"metrics overhead: {overhead:+.2f}% of decode throughput (end to end, with noise)")
    observe_us, render_us = direct_cost()
    per_request_s = totals["no-metrics"][0] / max(1, args.phases * args.rounds // 2)
    share = observe_us / (per_request_s * 1e6) * 100
    lines.append(f"direct cost: observe {observe_us:.1f} us per request (with a restore and a park), "
                 f"scrape {render_us:.1f} us; {share:.3f}% of this run's "
                 f"{per_request_s * 1000:.1f} ms per request")
    print("\n".join(lines))
    if args.out is not None:
        write_results(args, lines, {
            "engine": args.engine, "rounds": args.rounds, "phases": args.phases,
            "max_tokens": args.max_tokens, "server_args": args.server_arg,
            "tokens_per_s": rates, "seconds": {k: v[0] for k, v in totals.items()},
            "tokens": {k: v[1] for k, v in totals.items()}, "overhead_percent": overhead,
            "observe_us_per_request": observe_us, "scrape_us": render_us,
            "direct_percent_of_request": share, "ms_per_request": per_request_s * 1000})


def write_results(args: argparse.Namespace, lines: list[str], figures: dict) -> None:
    """``metrics-overhead-DATE-MACHINE-ENGINE.{md,json}`` in ``args.out``."""
    import datetime
    import platform

    date = datetime.date.today().isoformat()
    machine = f"{platform.machine()}-{'cuda' if any('cuda' in a for a in args.server_arg) else 'cpu'}"
    stem = args.out / f"metrics-overhead-{date}-{machine}-{args.engine}"
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {"date": date, "machine": machine, "cpus": os.cpu_count(),
               "command": " ".join(sys.argv), **figures}
    stem.with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    stem.with_suffix(".md").write_text(
        f"# Metrics overhead, {date}, {machine} ({os.cpu_count()} cores)\n\n"
        f"`python {' '.join(sys.argv)}`\n\n```\n" + "\n".join(lines) + "\n```\n")
    print(f"wrote {stem}.md and .json")


def direct_cost(n: int = 2000) -> tuple[float, float]:
    """Microseconds per ``ServerMetrics.observe`` of a one-choice request and per scrape, on
    an echo app's state (what the metrics add to each request and each scrape)."""
    from echo_app import echo_state
    from redlite.core.generation_request import GenerationResult
    from redlite.core.reuse import Action, MissReason, ReusePlan
    from redlite.server.metrics import ServerMetrics
    state = echo_state()
    try:
        metrics = ServerMetrics(state)
        plan = ReusePlan(Action.REWIND, 90, 90, 120, 130, MissReason.TOKEN_MISMATCH)
        result = GenerationResult("stop", 120, 64, 90, 12.0, 100.0, plan)
        scope = {"method": "POST", "route": None}
        started = time.perf_counter()
        for _ in range(n):  # the worst case: every request restores and parks a conversation
            metrics.observe(scope, 200, [result])
            metrics.moved("restore", "ram", 0.004)
            metrics.moved("park", "ram", 0.002)
        observe = (time.perf_counter() - started) / n * 1e6
        started = time.perf_counter()
        for _ in range(n // 10):
            metrics.render()
        render = (time.perf_counter() - started) / (n // 10) * 1e6
    finally:
        state.worker.shutdown(wait_s=2.0)
    return observe, render


if __name__ == "__main__":
    main()
