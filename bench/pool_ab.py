"""A/B of the CPU kernel library between two git revisions (or the work tree), in one process.

    PYTHONPATH=src python bench/pool_ab.py [--base HEAD] [--new WORKTREE]
                                           [--configs base:1:1,base:2:2,new:2:1,...]
                                           [--rounds 9] [--tokens 64] [--model bundled]

Builds ``redlite/kernels/*.c`` of each revision into its own shared library (each has its own
thread pool), loads the model once, then alternates rounds. A config ``LIB:POOL:TORCH`` runs
library LIB (base or new) with POOL threads in its pool and torch's intra-op threads at TORCH
during decode (the prefill before it runs on what the engine chooses). Per round and config:
``--tokens`` greedy decode steps through ``engine.decode`` with ``argmax`` on the logits (the
fused C step with the torch ops around it), then as many bare ``decode_step`` C calls at a fixed
position. Alternating in one process keeps a shared machine's load changes from favouring one
side. Prints the median tokens/s per config and the load average; ``--json`` writes them too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]


def build(rev: str, out_dir: Path) -> ctypes.CDLL:
    """The kernel library of git revision ``rev`` (``WORKTREE``: the files on disk)."""
    from redlite.kernels import native

    src = out_dir / rev.replace("/", "_")
    src.mkdir(parents=True, exist_ok=True)
    for name in (*native.SOURCES, *native.HEADERS):
        path = f"src/redlite/kernels/{name}"
        text = (ROOT / path).read_bytes() if rev == "WORKTREE" else subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        (src / name).write_bytes(text)
    so = src / "lib.so"
    subprocess.run(["cc", *native.FLAGS, "-o", str(so), *(str(src / n) for n in native.SOURCES), "-lm"],
                   check=True, timeout=300)
    lib = ctypes.CDLL(str(so))
    native._declare(lib)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--new", default="WORKTREE")
    ap.add_argument("--configs", default="base:1:1,base:2:2,new:2:1")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    configs = [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2])) for c in args.configs.split(",")]
    torch.set_num_threads(max(p for _, p, _ in configs))
    sys.path.append(str(ROOT / "bench"))
    from cpu import model_path
    from redlite.engine.factory import load_engine

    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(args.base, Path(tmp)), "new": build(args.new, Path(tmp))}
        engine, _ = load_engine(str(model_path(args.model)), ctx_size=2048, device="cpu")
        engine.reset()
        logits = engine.prefill(list(range(100, 116)))
        fused = engine.model._fused()
        assert fused, "no fused decode step for this model"
        first = int(logits.argmax())
        results: dict[str, dict[str, list[float]]] = {}
        texts: dict[str, list[int]] = {}
        for rnd in range(args.rounds + 1):  # round 0: warm-up, not counted
            for name, pool, tt in (configs if rnd % 2 else configs[::-1]):
                lib = libs[name]
                lib.set_threads(pool)
                fused.lib = lib
                engine.reset()
                engine.prefill(list(range(100, 116)))
                torch.set_num_threads(tt)
                token, out = first, []
                t = time.perf_counter()
                for _ in range(args.tokens):
                    token = int(engine.decode(token).argmax())
                    out.append(token)
                engine_tps = args.tokens / (time.perf_counter() - t)
                state, cache = engine.state, engine.state.cache.data
                cos, sin = fused.model.rotary.get(0, state.max_tokens)
                fused.struct.cos, fused.struct.sin = cos.data_ptr(), sin.data_ptr()
                buf = torch.empty(1, fused.struct.vocab)
                t = time.perf_counter()
                for _ in range(args.tokens):
                    lib.decode_step(ctypes.byref(fused.struct), token, state.n_past, cache.data_ptr(),
                                    state.max_tokens, buf.data_ptr())
                c_tps = args.tokens / (time.perf_counter() - t)
                texts.setdefault(name, out)
                if texts[name] != out:
                    print(f"warning: {name}:{pool}:{tt}: different greedy tokens", file=sys.stderr)
                if rnd:
                    r = results.setdefault(f"{name}:{pool}:{tt}", {"engine": [], "c": []})
                    r["engine"].append(engine_tps)
                    r["c"].append(c_tps)
        for lib in libs.values():
            lib.set_threads(1)
    same = len({tuple(t) for t in texts.values()}) == 1
    load = os.getloadavg()
    print(f"base={args.base} new={args.new} model={args.model} rounds={args.rounds} tokens={args.tokens} "
          f"load={load[0]:.2f} {load[1]:.2f} {load[2]:.2f} same_greedy={same}")
    print("| library:pool threads:torch threads | engine.decode tok/s median (min-max) | C decode_step tok/s median (min-max) |")
    print("|---|---|---|")
    summary = {}
    for key, r in sorted(results.items()):
        e, c = r["engine"], r["c"]
        summary[key] = {"engine_median": statistics.median(e), "c_median": statistics.median(c), **r}
        print(f"| {key} | {statistics.median(e):.1f} ({min(e):.1f}-{max(e):.1f}) | "
              f"{statistics.median(c):.1f} ({min(c):.1f}-{max(c):.1f}) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": load, "same_greedy": same,
                                               "results": summary}, indent=1))


if __name__ == "__main__":
    main()
