"""redlite against llama.cpp on CPU, side by side in one run, on the same GGUF files and threads.

    PYTHONPATH=src python bench/cpu.py [--threads 2] [--models bundled,random-1.5b] [--save]

For each model it runs, one after the other in fresh processes:

* llama.cpp's ``llama-bench`` (``-p PROMPT -n GEN -t THREADS -r REPS -o json``): prefill and
  decode tokens/s; its peak resident memory from ``wait4``;
* redlite's engine (``--child``): resident memory after load, prefill tokens/s at PROMPT
  random token ids from an empty state, decode tokens/s over GEN greedy steps after a
  16-token prompt (mean over REPS), peak resident memory;
* ``redlite serve`` twice: process start to ``/health`` answering (the second start uses the
  caches the first made).

Models: ``bundled`` (SmolLM2-135M Q4_1) and ``random-1.5b`` (a 1.5 B-class llama shape with
random Q4_K weights, written once by ``bench/random_gguf.py`` into the cache). ``llama-bench``
is looked for at ``--llama-bench``, on ``PATH`` and in ``~/.cache/redlite/llama.cpp/build/bin``;
when missing it is built there from the ``llama-cpp-python`` source package's vendored
llama.cpp (``GGML_NATIVE=OFF``, AVX-512 on: a native build may use instructions a VM hides;
about 15 minutes on 2 cores). ``--save`` writes ``bench/results/cpu-DATE-MACHINE.{md,json}``.
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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "redlite"
LLAMA_CPP_PYTHON = "0.3.36"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
               "-DGGML_AVX512_VNNI=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"]
RANDOM_SHAPE = {"layers": 28, "hidden": 1536, "inter": 8960, "heads": 12, "kv_heads": 2}


# --- llama.cpp ------------------------------------------------------------------------------

def find_or_build_llama_bench(explicit: str | None) -> Path:
    """Path of ``llama-bench``: ``explicit``, on PATH, in the cache, else built into the cache."""
    build = CACHE / "llama.cpp" / "build"
    for candidate in (explicit, shutil.which("llama-bench"), build / "bin" / "llama-bench"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    work = CACHE / "llama.cpp"
    work.mkdir(parents=True, exist_ok=True)
    source = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not source.is_dir():
        print(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON} (source) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)], check=True)
        subprocess.run(["tar", "xzf", str(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"), "-C", str(work)],
                       check=True)
    print(f"building llama-bench in {build} (about 15 minutes on 2 cores) ...", flush=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_FLAGS], check=True)
    subprocess.run(["nice", "-n", "19", "cmake", "--build", str(build), "--target", "llama-bench",
                    "-j", str(os.cpu_count() or 2)], check=True)
    return build / "bin" / "llama-bench"


def run_measured(cmd: list[str], **kwargs) -> tuple[str, int]:
    """Run ``cmd``; return (stdout, the child's peak resident memory in bytes, from wait4)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **kwargs)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
    return out, usage.ru_maxrss * 1024


def llama_cpp(bench: Path, model: Path, threads: int, prompt: int, gen: int, reps: int) -> dict:
    out, peak = run_measured([str(bench), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
                              "-r", str(reps), "-o", "json"], stderr=subprocess.DEVNULL)
    rows = json.loads(out)
    result = {"peak_rss_bytes": peak, "build": rows[0].get("build_commit")}
    for row in rows:
        key = "prefill_tps" if row["n_prompt"] else "decode_tps"
        result[key] = row["avg_ts"]
    return result


# --- redlite --------------------------------------------------------------------------------

def child(model: str, ctx: int, threads: int, prompt: int, gen: int, reps: int) -> None:
    """The redlite measurement, in its own process; prints one JSON line."""
    import random

    import torch

    torch.set_num_threads(threads)
    from redlite.engine.factory import load_engine

    started = time.perf_counter()
    engine, _ = load_engine(model, ctx_size=ctx, device="cpu")
    load_s = time.perf_counter() - started
    rss_after_load = _rss()
    rng = random.Random(0)
    ids = [rng.randrange(engine.vocab_size) for _ in range(prompt)]
    prefill = []
    for _ in range(reps):
        engine.reset()
        t = time.perf_counter()
        engine.prefill(ids)
        prefill.append(prompt / (time.perf_counter() - t))
    decode = []
    for _ in range(reps):
        engine.reset()
        logits = engine.prefill(ids[:16])
        t = time.perf_counter()
        for _ in range(gen):
            logits = engine.decode(int(logits.argmax()))
        decode.append(gen / (time.perf_counter() - t))
    print(json.dumps({"load_s": load_s, "rss_after_load_bytes": rss_after_load,
                      "prefill_tps": sum(prefill) / reps, "decode_tps": sum(decode) / reps,
                      "kv_bytes": int(engine.state.cache.data.numel() * engine.state.cache.data.element_size())}))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def redlite(model: Path, ctx: int, threads: int, prompt: int, gen: int, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out, peak = run_measured([sys.executable, __file__, "--child", str(model), "--ctx", str(ctx),
                              "--threads", str(threads), "--prompt", str(prompt), "--gen", str(gen),
                              "--reps", str(reps)], env=env)
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_bytes": peak}


def cold_start(model: Path, ctx: int, port: int) -> float:
    """Seconds from spawning ``redlite serve`` to ``/health`` answering 200."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "redlite.cli", "serve", "--model", str(model), "--port", str(port),
                             "--ctx-size", str(ctx)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redlite serve exited with {proc.returncode}")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the run --------------------------------------------------------------------------------

def model_path(name: str) -> Path:
    if name == "bundled":
        from redlite.loading.bundled import bundled_model_path

        return bundled_model_path()
    if name == "random-1.5b":
        path = CACHE / "bench" / "random-llama-1.5b-Q4_K.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            sys.path.insert(0, str(ROOT / "bench"))
            from random_gguf import write

            print(f"writing {path} ...", flush=True)
            write(path, model_path("bundled"), **RANDOM_SHAPE)
        return path
    raise SystemExit(f"unknown model {name!r}")


def load_average() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="bundled,random-1.5b")
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--llama-bench")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.ctx, args.threads, args.prompt, args.gen, args.reps)

    sys.path.insert(0, str(ROOT / "src"))
    bench = find_or_build_llama_bench(args.llama_bench)
    run = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.node(), "cpu": _cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
           "prompt_tokens": args.prompt, "decode_tokens": args.gen, "reps": args.reps, "ctx": args.ctx,
           "load_average_start": load_average(), "models": {}}
    for name in args.models.split(","):
        path = model_path(name)
        print(f"== {name}: {path.name} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
        starts = [cold_start(path, args.ctx, _free_port()) for _ in range(2)]
        ours = redlite(path, args.ctx, args.threads, args.prompt, args.gen, args.reps)
        theirs = llama_cpp(bench, path, args.threads, args.prompt, args.gen, args.reps)
        gguf_bytes = path.stat().st_size
        entry = {
            "gguf_bytes": gguf_bytes, "redlite": ours, "llama_cpp": theirs,
            "cold_start_s": {"first": starts[0], "second": starts[1]},
            "decode_ratio_vs_llama_cpp": ours["decode_tps"] / theirs["decode_tps"],
            "prefill_ratio_vs_llama_cpp": ours["prefill_tps"] / theirs["prefill_tps"],
            "rss_ratio_vs_llama_cpp": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
            "rss_after_load_vs_gguf_plus_kv": ours["rss_after_load_bytes"] / (gguf_bytes + ours["kv_bytes"]),
        }
        run["models"][name] = entry
        print(json.dumps(entry, indent=1), flush=True)
    run["load_average_end"] = load_average()
    report = markdown(run)
    print(report)
    if args.save:
        stem = f"cpu-{run['date'][:10]}-{re.sub(r'[^A-Za-z0-9]+', '-', run['machine'])[:40]}"
        out = ROOT / "bench" / "results"
        (out / f"{stem}.json").write_text(json.dumps(run, indent=1) + "\n")
        (out / f"{stem}.md").write_text(report)
        print(f"saved bench/results/{stem}.md and .json")


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def markdown(run: dict) -> str:
    mb = 1e6
    lines = [f"# CPU: redlite vs llama.cpp ({run['date']})", "",
             f"{run['cpu']}, {run['cores']} cores, {run['threads']} threads each; prefill of "
             f"{run['prompt_tokens']} tokens, {run['decode_tokens']} decode tokens, mean of {run['reps']} runs; "
             f"redlite ctx {run['ctx']}. Load average {run['load_average_start']} at the start, "
             f"{run['load_average_end']} at the end (a shared machine: other jobs ran alongside).", ""]
    for name, e in run["models"].items():
        ours, theirs = e["redlite"], e["llama_cpp"]
        lines += [f"## {name} ({e['gguf_bytes'] / mb:.0f} MB GGUF)", "",
                  "| figure | redlite | llama.cpp | ratio |", "|---|---|---|---|",
                  f"| decode tokens/s | {ours['decode_tps']:.1f} | {theirs['decode_tps']:.1f} | "
                  f"{e['decode_ratio_vs_llama_cpp']:.2f}x |",
                  f"| prefill tokens/s ({run['prompt_tokens']}) | {ours['prefill_tps']:.1f} | {theirs['prefill_tps']:.1f} | "
                  f"{e['prefill_ratio_vs_llama_cpp']:.2f}x |",
                  f"| peak resident MB | {ours['peak_rss_bytes'] / mb:.0f} | {theirs['peak_rss_bytes'] / mb:.0f} | "
                  f"{e['rss_ratio_vs_llama_cpp']:.2f}x |",
                  f"| resident MB after load (vs GGUF + KV {(e['gguf_bytes'] + ours['kv_bytes']) / mb:.0f} MB) | "
                  f"{ours['rss_after_load_bytes'] / mb:.0f} | | {e['rss_after_load_vs_gguf_plus_kv']:.2f}x |",
                  f"| cold start s (first, second) | {e['cold_start_s']['first']:.2f}, "
                  f"{e['cold_start_s']['second']:.2f} | | |", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
