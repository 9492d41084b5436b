"""redlite against llama.cpp on CPU, side by side in one run, on the same GGUF files and threads.

    PYTHONPATH=src python bench/cpu.py [--threads 2] [--models bundled,random-1.5b]
                                       [--prompts 256,1000] [--gen 64] [--reps 2] [--save]

For each model, one after the other in fresh processes:

* llama.cpp's ``llama-bench -p PROMPTS -n GEN -t THREADS -r REPS -o json``: prefill and decode
  tokens/s, its peak resident memory (``wait4``);
* redlite's engine (``--child``; ``--activations``: the decode products on 16-bit activations,
  the server's default, or float32 ones, or 8-bit ones as llama.cpp computes them): resident
  memory after load (in all, anonymous, mapped files), prefill tokens/s of each prompt length
  (random token ids, empty state), decode tokens/s over GEN greedy steps after a 16-token
  prompt (mean of REPS), peak resident memory;
* cold start, twice each (the second start uses what the first cached: the GGUF conversion, and
  Python's bytecode, written even where ``PYTHONDONTWRITEBYTECODE`` is set): ``redlite serve`` and
  ``llama-server``, process spawn to ``/health`` answering 200.

Models: ``bundled`` (SmolLM2-135M Q4_1) and ``random-1.5b`` (a 1.5 B-class llama shape with
random Q4_K weights, written once by ``bench/random_gguf.py`` into the cache). llama.cpp's
binaries are looked for at ``--llama-bin``, on ``PATH`` and in
``~/.cache/redlite/llama.cpp/build/bin``; ``bench/build_llamacpp.sh`` builds them there.
``--save`` writes ``bench/results/cpu-DATE-MACHINE.{md,json}`` (a later run of the same day
adds its models to the file; ``--machine`` names it, by default the host name).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/concurrent.py would hide the standard library's concurrent package (torch imports it)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
CACHE = Path.home() / ".cache" / "redlite"
RANDOM_SHAPE = {"layers": 28, "hidden": 1536, "inter": 8960, "heads": 12, "kv_heads": 2}


def llama_binary(name: str, explicit: str | None) -> Path:
    for candidate in (Path(explicit) / name if explicit else None, shutil.which(name),
                      CACHE / "llama.cpp" / "build" / "bin" / name):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise SystemExit(f"{name} not found: run bench/build_llamacpp.sh (about 15 minutes on 2 cores)")


def run_measured(cmd: list[str], **kwargs) -> tuple[str, int]:
    """Run ``cmd``; return (stdout, the child's peak resident memory in bytes, from wait4)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **kwargs)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[0]} exited with {os.waitstatus_to_exitcode(status)}")
    return out, usage.ru_maxrss * 1024


def llama_bench(bench: Path, model: Path, threads: int, prompts: list[int], gen: int, reps: int) -> dict:
    out, peak = run_measured([str(bench), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, prompts)),
                              "-n", str(gen), "-r", str(reps), "-o", "json"], stderr=subprocess.DEVNULL)
    result = {"peak_rss_bytes": peak, "prefill_tps": {}}
    for row in json.loads(out):
        result["build"] = row.get("build_commit")
        if row["n_prompt"]:
            result["prefill_tps"][str(row["n_prompt"])] = row["avg_ts"]
        else:
            result["decode_tps"] = row["avg_ts"]
    return result


def child(model: str, ctx: int, threads: int, prompts: list[int], gen: int, reps: int,
          activations: str = "q16") -> None:
    """The redlite measurement, in its own process; prints one JSON line."""
    import random

    import torch

    torch.set_num_threads(threads)
    from redlite.engine.factory import load_engine

    started = time.perf_counter()
    engine, _ = load_engine(model, ctx_size=ctx, device="cpu")
    load_s = time.perf_counter() - started
    memory_after_load = _memory()
    from redlite.layers.quant_weight import DECODE_ACTIVATIONS

    if activations != DECODE_ACTIVATIONS:  # the decode step on other activations than the server's
        from redlite.layers.cpu_decode import FusedDecode

        for module in engine.model.modules():
            if getattr(module, "is_quantized", False):
                module.activations = activations
        engine.model._fused_decode = FusedDecode.build(engine.model, activations=activations)
    rng = random.Random(0)
    prefill = {}
    for n in prompts:
        ids = [rng.randrange(engine.vocab_size) for _ in range(n)]
        rates = []
        for _ in range(reps):
            engine.reset()
            t = time.perf_counter()
            engine.prefill(ids)
            rates.append(n / (time.perf_counter() - t))
        prefill[str(n)] = sum(rates) / reps
    decode = []
    for _ in range(reps):
        engine.reset()
        logits = engine.prefill([rng.randrange(engine.vocab_size) for _ in range(16)])
        t = time.perf_counter()
        for _ in range(gen):
            logits = engine.decode(int(logits.argmax()))
        decode.append(gen / (time.perf_counter() - t))
    data = engine.state.cache.data
    print(json.dumps({"load_s": load_s, "rss_after_load_bytes": memory_after_load["VmRSS"],
                      "anon_after_load_bytes": memory_after_load["RssAnon"],
                      "file_after_load_bytes": memory_after_load["RssFile"], "prefill_tps": prefill,
                      "decode_tps": sum(decode) / reps, "kv_bytes": data.numel() * data.element_size()}))


def _memory() -> dict[str, int]:
    """This process's resident bytes: ``VmRSS`` in all, ``RssAnon`` (its own heap and anonymous
    mappings) and ``RssFile`` (mapped file pages: libraries, the GGUF; shared and reclaimable,
    and more of them counted where the page cache holds a file in large folios)."""
    with open("/proc/self/status") as f:
        status = f.read()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) * 1024
            for key in ("VmRSS", "RssAnon", "RssFile")}


def redlite(model: Path, ctx: int, threads: int, prompts: list[int], gen: int, reps: int,
            activations: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out, peak = run_measured([sys.executable, __file__, "--child", str(model), "--ctx", str(ctx),
                              "--threads", str(threads), "--prompts", ",".join(map(str, prompts)),
                              "--gen", str(gen), "--reps", str(reps), "--activations", activations], env=env)
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_bytes": peak}


def cold_start(cmd: list[str], port: int, env: dict | None = None) -> float:
    """Seconds from spawning ``cmd`` (a server on ``port``) to ``/health`` answering 200."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except OSError:
                time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def redlite_start(model: Path, ctx: int) -> float:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the second start reads the bytecode the first cached
    return cold_start([sys.executable, "-m", "redlite.cli", "serve", "--model", str(model), "--port", str(port),
                       "--ctx-size", str(ctx)], port, env)


def llama_server_start(server: Path, model: Path, ctx: int, threads: int) -> float:
    port = _free_port()
    return cold_start([str(server), "-m", str(model), "--port", str(port), "-c", str(ctx), "-t", str(threads)], port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_path(name: str) -> Path:
    if name == "bundled":
        from redlite.loading.bundled import bundled_model_path

        return bundled_model_path()
    if name == "random-1.5b":
        path = CACHE / "bench" / "random-llama-1.5b-Q4_K.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            sys.path.append(str(ROOT / "bench"))
            from random_gguf import write

            print(f"writing {path} ...", flush=True)
            write(path, model_path("bundled"), **RANDOM_SHAPE)
        return path
    raise SystemExit(f"unknown model {name!r}")


def interleaved_decode(path: Path, ctx: int, args, bench: Path) -> dict:
    """``args.interleave`` pairs of decode runs (``args.gen`` tokens after a 16-token prompt, one
    run each), redlite and llama.cpp alternating which goes first: on a shared machine the
    neighbours' load moves both sides of a pair alike. Returns both sides' rates per pair, their
    medians, and the median of the per-pair ratios."""
    ours, theirs = [], []
    for i in range(args.interleave):
        def run_ours():
            ours.append(redlite(path, ctx, args.threads, [16], args.gen, 1, args.activations)["decode_tps"])

        def run_theirs():
            theirs.append(llama_bench(bench, path, args.threads, [0], args.gen, 1)["decode_tps"])
        for run in ((run_ours, run_theirs) if i % 2 == 0 else (run_theirs, run_ours)):
            run()
        print(f"pair {i + 1}: redlite {ours[-1]:.1f}, llama.cpp {theirs[-1]:.1f} tok/s", flush=True)
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"redlite_tps": ours, "llama_cpp_tps": theirs, "redlite_median": statistics.median(ours),
            "llama_cpp_median": statistics.median(theirs), "ratio_median": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)]}


def load_average() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def measure(name: str, args, bench: Path, server: Path | None) -> dict:
    path = model_path(name)
    print(f"== {name}: {path.name} ({path.stat().st_size / 1e6:.0f} MB), load average {load_average()}", flush=True)
    prompts = [int(p) for p in args.prompts.split(",")]
    ctx = max(prompts) + args.gen + 64
    ours_start = [redlite_start(path, ctx) for _ in range(2)]
    theirs_start = [llama_server_start(server, path, ctx, args.threads) for _ in range(2)] if server else None
    ours = redlite(path, ctx, args.threads, prompts, args.gen, args.reps, args.activations)
    theirs = llama_bench(bench, path, args.threads, prompts, args.gen, args.reps)
    gguf_bytes = path.stat().st_size
    top = str(max(prompts))
    pairs = interleaved_decode(path, ctx, args, bench) if args.interleave else None
    return {
        **({"interleaved_decode": pairs} if pairs else {}),
        "gguf_bytes": gguf_bytes, "prompts": prompts, "decode_tokens": args.gen, "reps": args.reps, "ctx": ctx,
        "load_average": load_average(), "redlite": ours, "llama_cpp": theirs,
        "cold_start_s": {"redlite": ours_start, "llama_server": theirs_start},
        "decode_ratio_vs_llama_cpp": ours["decode_tps"] / theirs["decode_tps"],
        "prefill_ratio_vs_llama_cpp": ours["prefill_tps"][top] / theirs["prefill_tps"][top],
        "prefill_ratios_vs_llama_cpp": {p: ours["prefill_tps"][p] / theirs["prefill_tps"][p]
                                        for p in ours["prefill_tps"]},
        "rss_ratio_vs_llama_cpp": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
        "rss_after_load_vs_gguf_plus_kv": ours["rss_after_load_bytes"] / (gguf_bytes + ours["kv_bytes"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="bundled,random-1.5b")
    parser.add_argument("--prompts", default="256,1000", help="prefill lengths (comma-separated)")
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--activations", default="q16", choices=["q16", "float32", "q8"],
                        help="decode products on 16-bit activations (redlite's default; the float32 "
                             "reference's text on the regression prompts), float32 ones, or 8-bit "
                             "ones, as llama.cpp computes them")
    parser.add_argument("--interleave", type=int, default=0,
                        help="then N decode runs of each side, alternating (a fairer ratio on a shared machine)")
    parser.add_argument("--llama-bin", help="folder holding llama-bench and llama-server")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--machine", default=platform.node(),
                        help="the machine's name in the results file (default: the host name)")
    parser.add_argument("--report", type=Path, help="only re-render the markdown of a saved JSON result")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        args.report.with_suffix(".md").write_text(markdown(json.loads(args.report.read_text())))
        return None
    if args.child:
        return child(args.child, args.ctx, args.threads, [int(p) for p in args.prompts.split(",")], args.gen,
                     args.reps, args.activations)

    sys.path.insert(0, str(ROOT / "src"))
    bench = llama_binary("llama-bench", args.llama_bin)
    try:
        server = llama_binary("llama-server", args.llama_bin)
    except SystemExit:
        server = None
    run = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": args.machine, "cpu": _cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
           "command": "PYTHONPATH=src python bench/cpu.py " + " ".join(sys.argv[1:]),
           "load_average_start": load_average(), "models": {}}
    for name in args.models.split(","):
        key = name if args.threads == 2 else f"{name}, {args.threads} threads"
        key += "" if args.activations == "q16" else f", {args.activations} activations"
        run["models"][key] = {**measure(name, args, bench, server), "threads": args.threads,
                              "activations": args.activations}
        print(json.dumps(run["models"][key], indent=1), flush=True)
    run["load_average_end"] = load_average()
    if args.save:
        save(run)
    print(markdown(run))


def save(run: dict) -> None:
    stem = f"cpu-{run['date'][:10]}-{re.sub(r'[^A-Za-z0-9]+', '-', run['machine'])[:40]}"
    out = ROOT / "bench" / "results"
    if (out / f"{stem}.json").exists():  # another run of the same day: its other models stay
        earlier = json.loads((out / f"{stem}.json").read_text())
        run["models"] = {**earlier.get("models", {}), **run["models"]}
    (out / f"{stem}.json").write_text(json.dumps(run, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(run))
    print(f"saved bench/results/{stem}.md and .json")


def markdown(run: dict) -> str:
    mb = 1e6
    lines = [f"# CPU: redlite vs llama.cpp ({run['date']})", "",
             f"`{run.get('command', 'bench/cpu.py')}`", "",
             f"{run['cpu']}, {run['cores']} cores. A shared machine: other jobs "
             "ran alongside (load average per model below), so absolute figures are those of a starved process; "
             "both sides ran under the same conditions, one after the other.", ""]
    for name, e in run["models"].items():
        ours, theirs = e["redlite"], e["llama_cpp"]
        lines += [f"## {name} ({e['gguf_bytes'] / mb:.0f} MB GGUF)", "",
                  f"{e.get('threads', run['threads'])} threads each, redlite decode on "
                  f"{e.get('activations', 'float32')} activations, {e['decode_tokens']} decode tokens, mean of {e['reps']} runs; load average {e['load_average']} "
                  "when done.", "", "| figure | redlite | llama.cpp | ratio |", "|---|---|---|---|",
                  f"| decode tokens/s | {ours['decode_tps']:.1f} | {theirs['decode_tps']:.1f} | "
                  f"{e['decode_ratio_vs_llama_cpp']:.2f}x |"]
        pairs = e.get("interleaved_decode")
        if pairs:
            lines.append(f"| decode tokens/s, {len(pairs['redlite_tps'])} "
                         f"interleaved runs each (medians; ratio: median of the pairs' ratios, range "
                         f"{pairs['ratio_range'][0]:.2f}-{pairs['ratio_range'][1]:.2f}) | {pairs['redlite_median']:.1f} | "
                         f"{pairs['llama_cpp_median']:.1f} | {pairs['ratio_median']:.2f}x |")
        for p, ratio in e["prefill_ratios_vs_llama_cpp"].items():
            lines.append(f"| prefill tokens/s ({p}) | {ours['prefill_tps'][p]:.1f} | {theirs['prefill_tps'][p]:.1f} | "
                         f"{ratio:.2f}x |")
        starts = e["cold_start_s"]
        theirs_start = ", ".join(f"{s:.2f}" for s in starts["llama_server"]) if starts["llama_server"] else "-"
        lines += [f"| peak resident MB | {ours['peak_rss_bytes'] / mb:.0f} | {theirs['peak_rss_bytes'] / mb:.0f} | "
                  f"{e['rss_ratio_vs_llama_cpp']:.2f}x |",
                  f"| resident MB after load (GGUF + KV {(e['gguf_bytes'] + ours['kv_bytes']) / mb:.0f} MB) | "
                  f"{ours['rss_after_load_bytes'] / mb:.0f} | | {e['rss_after_load_vs_gguf_plus_kv']:.2f}x |",
                  *([f"| of which anonymous / mapped files MB | {ours['anon_after_load_bytes'] / mb:.0f} / "
                     f"{ours['file_after_load_bytes'] / mb:.0f} | | |"] if "anon_after_load_bytes" in ours else []),
                  f"| cold start to /health, s (first, second) | "
                  f"{', '.join(f'{s:.2f}' for s in starts['redlite'])} | {theirs_start} | |", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
