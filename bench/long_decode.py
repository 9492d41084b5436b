"""Decode speed deep into a conversation, through the servers: redlite against llama-server.

    PYTHONPATH=src python bench/long_decode.py [--depths 500,2000,4000,7000] [--gen 96]
                                               [--pairs 2] [--kv-dtypes float32,float16] [--save]

An agent's conversation holds thousands of tokens, and every token it decodes attends over all of
them: past a few thousand, the attention's reading of the cache, not the weights, sets the speed.
The servers serve the bundled GGUF (as many threads as the machine has cores each, context
8,192, llama-server with its default f16 cache, one redlite server per ``--kv-dtypes`` value) at
once; for each depth, ``--pairs`` rounds of one streamed chat request to each server (the order
rotating from round to round, so the shared machine's load moves every side alike): the first DEPTH tokens (about) of ``bench/fixtures/long_context.txt`` plus a request
for a long essay, greedy, ``--gen`` tokens. Decode rate = (content chunks - 1) / (last chunk's
time - first chunk's time) on the client; the servers stream one token per chunk. Prints medians
and, per redlite server, the median of the rounds' ratios to llama-server; ``--save`` writes ``bench/results/long-decode-DATE-MACHINE``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT / "tests"))
from server_process import ServerProcess, free_port  # noqa: E402

TEXT = (ROOT / "bench" / "fixtures" / "long_context.txt").read_text()
ASK = "\n\nWrite a long, detailed essay about the text above, section by section."
CHARS_PER_TOKEN = 4.3  # of this text in SmolLM2's tokenizer (depths are approximate)


def stream_decode(url: str, text: str, gen: int) -> tuple[float, int]:
    """(decode tokens/s between the first and the last content chunk, chunks) of one request."""
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": gen,
            "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                if delta and delta[0].get("delta", {}).get("content"):
                    times.append(time.perf_counter())
    if len(times) < 8:
        raise RuntimeError(f"only {len(times)} content chunks from {url}")
    return (len(times) - 1) / (times[-1] - times[0]), len(times)


class LlamaServer:
    def __init__(self, binary: Path, model: Path, ctx: int, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(binary), "-m", str(model), "--port", str(self.port), "-c", str(ctx),
                                      "-t", str(threads), "-np", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="500,2000,4000,7000")
    parser.add_argument("--gen", type=int, default=96)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--kv-dtypes", default="float32",
                        help="redlite's --kv-dtype values, one server each (e.g. float32,float16)")
    parser.add_argument("--llama-bin", help="folder holding llama-server")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--machine", default=platform.node())
    args = parser.parse_args()
    sys.path.append(str(ROOT / "bench"))  # last: bench/concurrent.py must not hide the standard one
    from cpu import llama_binary, load_average

    from redlite.loading.bundled import bundled_model_path
    model = bundled_model_path()
    depths = [int(d) for d in args.depths.split(",")]
    kv_dtypes = args.kv_dtypes.split(",")
    run = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": args.machine, "threads": os.cpu_count(), "gen": args.gen, "kv_dtypes": kv_dtypes,
           "command": "PYTHONPATH=src python bench/long_decode.py " + " ".join(sys.argv[1:]),
           "load_average_start": load_average(), "depths": {}}
    servers = {f"redlite_{kv}": ServerProcess("--model", str(model), "--ctx-size", "8192", "--kv-dtype", kv,
                                              engine="torch", timeout_s=300) for kv in kv_dtypes}
    try:
        servers["llama_cpp"] = LlamaServer(llama_binary("llama-server", args.llama_bin), model, 8192,
                                           os.cpu_count())
        names = list(servers)
        for depth in depths:
            rates: dict[str, list[float]] = {name: [] for name in names}
            for i in range(args.pairs):
                # a different start per round: no server reuses the previous request's prompt
                text = TEXT[i * 50:i * 50 + int(depth * CHARS_PER_TOKEN)] + ASK
                order = names[i % len(names):] + names[:i % len(names)]  # rotated: load moves all alike
                for name in order:
                    rates[name].append(stream_decode(servers[name].url, text, args.gen)[0])
                print(f"depth {depth} round {i + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names)
                      + " tok/s", flush=True)
            row = {**rates}
            for name in names:
                row[f"{name}_median"] = statistics.median(rates[name])
                if name != "llama_cpp":
                    row[f"{name}_ratio_median"] = statistics.median(
                        a / b for a, b in zip(rates[name], rates["llama_cpp"]))
            run["depths"][str(depth)] = row
    finally:
        for server in servers.values():
            server.stop()
    run["load_average_end"] = load_average()
    text = markdown(run)
    print(text)
    if args.save:
        stem = f"long-decode-{run['date'][:10]}-{re.sub(r'[^A-Za-z0-9]+', '-', args.machine)[:40]}"
        (ROOT / "bench" / "results" / f"{stem}.json").write_text(json.dumps(run, indent=1) + "\n")
        (ROOT / "bench" / "results" / f"{stem}.md").write_text(text)
        print(f"saved bench/results/{stem}.md and .json")


def markdown(run: dict) -> str:
    kv = run["kv_dtypes"]
    lines = [f"# Decode deep into a conversation, through the servers ({run['date']})", "",
             f"`{run['command']}`", "",
             f"Bundled SmolLM2-135M Q4_1, {run['threads']} threads each, {run['gen']} greedy tokens per "
             f"request, streamed; llama-server with its default f16 cache; load average "
             f"{run['load_average_start']} at the start, {run['load_average_end']} at the end (a shared "
             "machine).", "",
             "| depth (prompt tokens, about) | " + " | ".join(f"redlite {k} cache tok/s" for k in kv)
             + " | llama-server tok/s | " + " | ".join(f"ratio {k} (median of rounds)" for k in kv) + " |",
             "|---:|" + "---:|" * (2 * len(kv) + 1)]
    for depth, row in run["depths"].items():
        lines.append(f"| {depth} | " + " | ".join(f"{row[f'redlite_{k}_median']:.1f}" for k in kv)
                     + f" | {row['llama_cpp_median']:.1f} | "
                     + " | ".join(f"{row[f'redlite_{k}_ratio_median']:.2f}x" for k in kv) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
