"""One decode step at a long context through the engine's three paths, on the same weights:
the fork ideal of bench/serve_gpu.py (a one-token prefill + reading its argmax), the served
token stream (sampling inside the captured step, read one token behind), and
``engine.decode`` + a host argmax; on the KV rows as they are after the warm-up, then on
random ones.

Usage (on a CUDA machine)::

    PYTHONPATH=src python3 bench/step_paths.py --shape 8b --held 32812

Prints min / median ms per step. A served request's log rate (tokens after the first / time
from before the first was read) counts one step more than it divides by: with 8 tokens it
reads 8/7 of the step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_gpu as sg  # noqa: E402

from redlite.engine.base import SamplingParams  # noqa: E402
from redlite.engine.torch_engine import TorchEngine  # noqa: E402
from redlite.engine.warmup import warm_up  # noqa: E402
from redlite.models.llama import LlamaModel  # noqa: E402


def _ms(times: list[float]) -> str:
    return f"min {1e3 * min(times):.2f} med {1e3 * statistics.median(times):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8b", choices=[s for s in sg.SHAPES])
    parser.add_argument("--held", type=int, default=32812)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    ctx = 2 * args.held + 4096
    cfg, tensors = sg.llama_tensors(args.shape, 49152, ctx, frozenset({2}))
    model = LlamaModel(cfg, device=sg.DEVICE, dtype=torch.bfloat16)
    model.load_hf_weights(tensors)
    del tensors
    engine = TorchEngine(model.eval(), ctx_size=ctx, device=sg.DEVICE, dtype=torch.bfloat16)
    started = time.perf_counter()
    warm_up(engine)
    print(f"{args.shape}: warm-up {time.perf_counter() - started:.1f} s; {args.held} held tokens")

    def ideal() -> list[float]:
        out = []
        for _ in range(8):
            engine.reset()
            engine.state.n_past = args.held
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            int(torch.argmax(engine.prefill([5])))
            out.append(time.perf_counter() - t0)
        return out

    def stream() -> list[float]:
        engine.reset()
        engine.state.n_past = args.held
        tokens = engine.token_stream(SamplingParams(temperature=0.0), engine.prefill([5]))
        tokens.feed()
        tokens.read()
        out = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            tokens.feed()
            tokens.read()
            out.append(time.perf_counter() - t0)
        return out

    def decode() -> list[float]:
        engine.reset()
        engine.state.n_past = args.held
        logits = engine.decode(1)
        out = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            logits = engine.decode(int(torch.argmax(logits)))
            out.append(time.perf_counter() - t0)
        return out

    for label in ("KV as after the warm-up", "random KV"):
        if label == "random KV":
            with torch.inference_mode():
                engine.state.cache.data[:, :, :, :args.held + 2 * args.steps].normal_()
        print(f"{label}: fork ideal {_ms(ideal())} | token stream {_ms(stream())} | "
              f"engine.decode {_ms(decode())}")


if __name__ == "__main__":
    main()
