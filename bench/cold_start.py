"""Cold start of ``redlite serve`` from several source trees, interleaved (A/B under the same load).

    python bench/cold_start.py --src A/src --src B/src [--runs 6] [--model PATH] [--ctx 1128]

Each round starts the server once from each tree (``PYTHONPATH=TREE``), in turn, and times
process spawn to ``/health`` answering 200 (``bench/cpu.py``'s measure); a first round, not
counted, lets each tree cache its conversion and bytecode. Prints every time, then per tree the
median and the minimum, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu import _free_port, cold_start, load_average  # noqa: E402


def start_once(src: str, model: str | None, ctx: int) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    port = _free_port()
    cmd = [sys.executable, "-m", "redlite.cli", "serve", "--port", str(port), "--ctx-size", str(ctx)]
    return cold_start(cmd + (["--model", model] if model else []), port, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", required=True, help="a source tree (repeatable)")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--model", help="GGUF file (default: the bundled model)")
    parser.add_argument("--ctx", type=int, default=1128)
    args = parser.parse_args()
    print(f"load average before: {load_average()}", flush=True)
    for src in args.src:
        start_once(src, args.model, args.ctx)
    times: dict[str, list[float]] = {src: [] for src in args.src}
    for run in range(args.runs):
        for src in args.src:
            times[src].append(start_once(src, args.model, args.ctx))
        print(f"round {run + 1}: " + ", ".join(f"{times[s][-1]:.2f}" for s in args.src), flush=True)
    print(f"load average after: {load_average()}")
    for src, values in times.items():
        print(f"{src}: median {statistics.median(values):.2f} s, min {min(values):.2f} s over {len(values)}")


if __name__ == "__main__":
    main()
