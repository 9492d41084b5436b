"""The host (Python) time of a fork's candidate step and parking bookkeeping, on CPU.

A regenerate (the same prompt again) on a conversation of about H held tokens
(``--held``), through the generation layer as the server's engine worker runs it:
:class:`~redlite.core.generation.Generator` with the CLI's default settings,
:class:`~redlite.core.conversations.Conversations` over a pool of the CLI's defaults
(2 GiB, 8 entries, 4 GiB device budget) and an exact-replay store that records every answer,
as the chat service does. The model has the layer count of the GPU's (``--layers``: 32, the
Qwen3.5-9B hybrid pattern of three Gated DeltaNet layers per attention layer, or a Llama) but
a tiny width, so the device copies cost next to nothing and what is timed is the Python
work that also runs, unchanged, in front of an H200.

Per family and held size: one new conversation (prefilled in 512-token chunks, a checkpoint
at every message boundary of the hybrid), then ``--reps`` regenerates (greedy, ``max_tokens``
8). Every stage is timed through wrappers installed here (the library code is unchanged), in
the thread's CPU time (``--clock cpu``, the default: other load on the machine does not count)
or wall time (``--clock wall``); the generator's TTFT on the same clock. Medians after the
first ``--skip`` rounds, microseconds:

* select: the candidate step (:meth:`Conversations.select`; parks the old answer's tail);
* park_live: that park's copy and bookkeeping, inside select;
* plan+execute: the reuse plan and bringing the engine to the prompt's end (a restore);
* settle: the parking bookkeeping done once the prefill is queued (:meth:`Parker.settle`);
* ttft_host: the generator's TTFT less the engine calls inside it (restore, prefill, range
  copies): the host's part.

``--profile N``: also print cProfile's top N functions (cumulative) inside select,
plan+execute and settle over the timed rounds.

Usage: PYTHONPATH=src python bench/fork_host.py [--family hybrid,llama] [--held 1024,32768]
    [--reps 300] [--out bench/results --tag NAME]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from redlite.core.byte_tokenizer import VOCAB_SIZE, ByteTokenizer
from redlite.core.conversations import Conversations
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GeneratorSettings
from redlite.core.parker import Parker
from redlite.core.parking import ParkingPool
from redlite.core.replay import ReplayStore
from redlite.core.replay_record import record_turn
from redlite.engine.base import SamplingParams
from redlite.engine.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parent.parent
STAGES = [("select", Conversations, "select"), ("park_live", Parker, "park_live"),
          ("plan+execute", Generator, "_plan_and_execute"), ("settle", Parker, "settle")]
ENGINE_CALLS = ("restore_checkpoint", "rewind", "prefill", "snapshot_range", "restore_range")


def build(family: str, layers: int, ctx: int) -> TorchEngine:
    """A tiny-width model of ``layers`` layers with seeded random weights, on an engine."""
    torch.manual_seed(0)
    if family == "hybrid":
        from redlite.models.qwen3_5 import Qwen3_5Model
        types = [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(layers)]
        config = transformers.Qwen3_5TextConfig(
            vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=types, max_position_embeddings=ctx)
        model = Qwen3_5Model(config.to_dict())
    else:
        from redlite.models.llama import LlamaModel
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          vocab_size=VOCAB_SIZE, max_position_embeddings=ctx)
        model = LlamaModel(config.to_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    return TorchEngine(model.eval(), ctx_size=ctx)


class Stamps:
    """Wrappers around the stages and engine calls; durations (ns) per label of this round."""

    def __init__(self, clock, profile: cProfile.Profile | None = None) -> None:
        self.clock = clock  # ns
        self.round: dict[str, int] = {}
        self.undo: list = []
        self.profile = profile  # enabled inside the outer stages of a timed round
        self.timed_round = False

    def wrap(self, owner, name: str, label: str, profiled: bool = False) -> None:
        fn = getattr(owner, name)
        stamps = self

        def timed(*args, **kwargs):
            on = profiled and stamps.profile is not None and stamps.timed_round
            if on:
                stamps.profile.enable()
            t0 = stamps.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                stamps.round[label] = stamps.round.get(label, 0) + stamps.clock() - t0
                if on:
                    stamps.profile.disable()
        setattr(owner, name, timed)
        self.undo.append((owner, name, fn))

    def restore(self) -> None:
        for owner, name, fn in reversed(self.undo):
            setattr(owner, name, fn)
        self.undo.clear()


def conversation(held: int, seed: int) -> tuple[list[int], list[int], list]:
    """A prompt of about ``held`` tokens: a system message, then user/assistant turns of ~400
    tokens; (ids, message ends, message info)."""
    import random
    rng = random.Random(seed)
    ids, ends, info = [], [], []
    roles = ["system"] + ["user", "assistant"] * (held // 800 + 1)
    for i, role in enumerate(roles):
        n = min(60 if i == 0 else 400, held - len(ids))
        if n <= 0:
            break
        ids += [rng.randrange(3, 256) for _ in range(n)]
        ends.append(len(ids))
        info.append((role, None))
    if info[-1][0] != "user":
        ids += [rng.randrange(3, 256) for _ in range(20)]
        ends.append(len(ids))
        info.append(("user", None))
    return ids + [10, 11, 12], ends, info  # the generation prompt after the last boundary


def run_case(family: str, held: int, args, profile: cProfile.Profile | None) -> dict:
    engine = build(family, args.layers, held + 256)
    tok = ByteTokenizer()
    cpu = args.clock == "cpu"
    gen = Generator(engine, tok, GeneratorSettings(), clock=time.thread_time if cpu else time.perf_counter)
    gen.parking = Conversations(ParkingPool(2048 << 20, 8, device_budget_bytes=4096 << 20), None)
    store = ReplayStore()
    gen.parking.attach_replay(store)
    prompt, ends, info = conversation(held, seed=held)

    def request(i: int) -> GenerationRequest:
        # the same prompt list each time, as the server's render cache gives back
        return GenerationRequest(prompt, max_tokens=8, sampling=SamplingParams(temperature=0.0),
                                 message_ends=list(ends), request_id=f"r{i}", message_info=list(info))

    stamps = Stamps(time.thread_time_ns if cpu else time.perf_counter_ns, profile)
    for label, owner, name in STAGES:
        stamps.wrap(owner, name, label, profiled=label != "park_live")
    for name in ENGINE_CALLS:
        if hasattr(engine, name):
            stamps.wrap(engine, name, "engine")
    rows = []
    try:
        for i in range(args.reps + args.skip + 1):
            req = request(i)
            stamps.round, stamps.timed_round = {}, i > args.skip
            *_, result = gen.run(req)
            record_turn(store, tok, req, result)
            if i == 0:
                continue  # the new conversation
            assert result.cached_tokens >= len(prompt) - 1, (i, result.plan)
            us = {k: v / 1e3 for k, v in stamps.round.items()}
            us["ttft"] = result.ttft_ms * 1e3
            rows.append(us)
    finally:
        stamps.restore()
    rows = rows[args.skip:]
    medians = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}
    medians["ttft_host"] = statistics.median(r["ttft"] - r.get("engine", 0.0) for r in rows)
    return {"family": family, "held": len(prompt), "rounds": len(rows),
            "pool_entries": len(gen.parking.pool), "median_us": {k: round(v, 1) for k, v in medians.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="hybrid,llama")
    parser.add_argument("--held", default="1024,32768")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=20, help="first regenerates left out")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    profile = cProfile.Profile() if args.profile else None
    cases = [run_case(f, int(h), args, profile) for f in args.family.split(",") for h in args.held.split(",")]
    order = ["select", "park_live", "plan+execute", "settle", "engine", "ttft", "ttft_host"]
    order += sorted({k for c in cases for k in c["median_us"]} - set(order))
    lines = ["| stage (µs) | " + " | ".join(f"{c['family']} {c['held']}" for c in cases) + " |",
             "|---|" + "---:|" * len(cases)]
    for key in order:
        lines.append(f"| {key} | " + " | ".join(f"{c['median_us'].get(key, 0.0):.0f}" for c in cases) + " |")
    print("\n".join(lines))
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)
    if args.out:
        date = datetime.date.today().isoformat()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        command = "PYTHONPATH=src python bench/fork_host.py " + " ".join(sys.argv[1:])
        stem = Path(args.out) / f"fork-host-{date}-{args.tag}"
        meta = {"command": command, "date": date, "commit": commit, "clock": args.clock, "machine": platform.machine(),
                "python": platform.python_version(), "torch": torch.__version__}
        stem.with_suffix(".json").write_text(json.dumps({**meta, "cases": cases}, indent=1) + "\n")
        stem.with_suffix(".md").write_text(
            f"# Fork host time (regenerate), {date}, {args.tag}\n\nCommand: `{command}` at commit {commit}; "
            f"medians over the rounds, microseconds (see bench/fork_host.py).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
