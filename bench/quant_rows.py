"""Single-product speed of the CPU decode kernel (``qmatvec_q16x``: one token, 16-bit
activations) per GGUF format: GB/s of weight bytes read and weights per second.

30 random weights of 4096 x 1536 per format (~80-190 MB in all: beyond the caches), one token
each, on ``--threads`` kernel threads; best of ``--reps`` passes. ``--src DIR`` runs another
tree's sources (e.g. ``git archive COMMIT src | tar -x -C /tmp/base``, then ``--src
/tmp/base/src``) for a before/after in one sitting; rows alternate between the trees.

Usage: PYTHONPATH=src python bench/quant_rows.py [--src DIR ...] [--threads 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def child(fmt: str, threads: int, reps: int) -> dict:
    import time

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from test_quant_kernels import random_blocks

    from redlite.kernels import native
    from redlite.layers.quant_weight import QuantWeight

    native.set_threads(threads)
    weights = [QuantWeight([random_blocks(fmt, 4096, 1536, i)], "q16") for i in range(30)]
    nbytes = sum(w.part0.numel() for w in weights)
    x = torch.randn(1, 1536)
    best = float("inf")
    for _ in range(reps + 1):  # the first pass warms up
        started = time.perf_counter()
        for w in weights:
            w.linear(x)
        best = min(best, time.perf_counter() - started)
    return {"GBps": nbytes / best / 1e9, "Gweights_s": 30 * 4096 * 1536 / best / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", default=[], help="another tree's src folder (repeatable)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    trees = [str(ROOT / "src"), *args.src]
    rows = {}
    for fmt in FORMATS:
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, __file__, "--child", fmt, str(args.threads), str(args.reps)],
                                 env=env, capture_output=True, text=True, check=True, timeout=600)
            rows[fmt, tree] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Command: `PYTHONPATH=src python bench/quant_rows.py {' '.join(sys.argv[1:])}`; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print("| format | " + " | ".join(f"{t}: GB/s (Gweights/s)" for t in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for fmt in FORMATS:
        cells = [f"{rows[fmt, t]['GBps']:.1f} ({rows[fmt, t]['Gweights_s']:.1f})" for t in trees]
        print(f"| {fmt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
