"""What a fork costs: parking only the discarded tail against parking the whole state.

In-process (Generator + Conversations + TorchEngine, random weights of a small Llama shape, or
``--shape`` 1b on a GPU), for each held size: a conversation of ``held`` tokens is prefilled
and answered, then

- a regenerate (the same prompt again: the answer's tokens are the tail) and
- a fork (the last ``--suffix`` prompt tokens changed: they and the answer are the tail)

run with parking on; the same requests on a generator without parking give the ideal (rewind +
suffix prefill + one token). Printed per size: tokens and bytes parked (tail) and their tier
(``device`` on a GPU within ``--park-device-mib``'s default, else ``ram``) against the whole
state's bytes and the time a whole capture takes (what parking cost before), the park time
from the log line, the selection step's time (all that forking adds: candidates, parking,
restoring), TTFT with parking, the ideal, and the excess (TTFT - ideal; issue 16's target:
<= 5 ms), medians of ``--repeat``. Then the old branch is continued (its tail restored:
time from the log line) and its greedy tokens compared with a cold engine's. Last, issue 16's
six requests (``--scenario``: two conversations answered, regenerated and continued): each
request's park line, and the pool's bytes afterwards against whole copies of its entries.

Usage: PYTHONPATH=src .venv/bin/python bench/fork.py [--sizes 1024,4096,8192] [--repeat 3]
       [--device cpu|cuda] [--shape small|1b] [--out DIR]
(H200: ``--device cuda --shape 1b --sizes 1024,8192,32768 --machine nvidia-h200``)
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import transformers  # noqa: E402

from redlite.core.byte_tokenizer import ByteTokenizer  # noqa: E402
from redlite.core.conversations import Conversations  # noqa: E402
from redlite.core.live_state import capture  # noqa: E402
from redlite.core.generation import Generator  # noqa: E402
from redlite.core.generation_request import GenerationRequest, GeneratorSettings  # noqa: E402
from redlite.core.parking import ParkingPool  # noqa: E402
from redlite.engine.base import SamplingParams  # noqa: E402
from redlite.engine.torch_engine import TorchEngine  # noqa: E402
from redlite.models.llama import LlamaModel  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "small": (256, 688, 4, 4, 4, 261),
    "1b": (2048, 8192, 16, 32, 8, 261),  # the byte tokenizer's vocabulary
}


class ParkLog(logging.Handler):
    """Collects the ``parked N tok (B bytes) in X ms ... tier=T`` and ``restored from T N tok in
    X ms`` lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.parks: list[tuple[int, int, float, str]] = []
        self.restores: list[tuple[str, int, float]] = []

    def emit(self, record):
        message = record.getMessage()
        m = re.search(r"parked (\d+) tok \((\d+) bytes\) in ([\d.]+) ms: .* tier=(\w+)", message)
        if m:
            self.parks.append((int(m[1]), int(m[2]), float(m[3]), m[4]))
        m = re.search(r"restored from (\w+) (\d+) tok in ([\d.]+) ms", message)
        if m:
            self.restores.append((m[1], int(m[2]), float(m[3])))


def build(shape: str, device: str, ctx: int) -> LlamaModel:
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                      max_position_embeddings=ctx)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LlamaModel(config.to_dict(), device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((0.02 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    return model.eval()


def run(gen: Generator, ids: list[int], max_tokens: int):
    request = GenerationRequest(list(ids), max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
    return list(gen.run(request))[-1]


class TimedConversations(Conversations):
    """Conversations timing its selection step (candidates, parking the live tail, restoring):
    what forking adds to a request, wall ms per call in ``select_ms``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.select_ms: list[float] = []

    def select(self, *args, **kwargs) -> None:
        started = time.perf_counter()
        super().select(*args, **kwargs)
        self.select_ms.append((time.perf_counter() - started) * 1000.0)


def fresh_parking() -> TimedConversations:
    return TimedConversations(ParkingPool(8 << 30, 8, device_budget_bytes=4 << 30), None)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model, device: str, held: int, suffix: int, answer: int, repeat: int, vocab: int) -> dict:
    tok = ByteTokenizer()
    ctx = held + 64
    parked = Generator(TorchEngine(model, ctx_size=ctx, device=device), tok, GeneratorSettings())
    ideal = Generator(TorchEngine(model, ctx_size=ctx, device=device), tok, GeneratorSettings())
    handler = ParkLog()
    logging.getLogger("redlite.parking").addHandler(handler)
    logging.getLogger("redlite.parking").setLevel(logging.INFO)
    prompt = [(i * 2654435761) % (vocab - 10) for i in range(held - answer)]
    fork = prompt[:-suffix] + [(t + 1) % (vocab - 10) for t in prompt[-suffix:]]
    out: dict = {"held": held, "suffix": suffix}
    for name, second in (("regenerate", prompt), ("fork", fork)):
        ttft, ttft_ideal, parks, whole_ms, select_ms = [], [], [], [], []
        for _ in range(repeat):
            parked.parking = None
            for gen in (parked, ideal):
                run(gen, prompt, answer)
            parked.parking = fresh_parking()  # the server's defaults: 4 GiB on the device
            sync(device)
            started = time.perf_counter()
            whole = capture(parked, "probe", 0.0)  # what parking cost before: the whole state
            sync(device)
            whole_ms.append((time.perf_counter() - started) * 1000.0)
            whole_bytes = whole.nbytes
            del whole
            handler.parks.clear()
            ttft.append(run(parked, second, 1).ttft_ms)
            parks.append(handler.parks[-1])
            select_ms.append(parked.parking.select_ms[-1])
            ttft_ideal.append(run(ideal, second, 1).ttft_ms)
        tokens, nbytes, _, tier = parks[-1]
        out[name] = {"tail_tokens": tokens, "tail_bytes": nbytes, "tier": tier,
                     "whole_bytes": whole_bytes, "whole_capture_ms": statistics.median(whole_ms),
                     "park_ms": statistics.median(p[2] for p in parks),
                     "select_ms": statistics.median(select_ms),
                     "ttft_ms": statistics.median(ttft), "ideal_ms": statistics.median(ttft_ideal)}
        out[name]["excess_ms"] = out[name]["ttft_ms"] - out[name]["ideal_ms"]
    # the old branch back: restored from its tail, greedy tokens as a cold engine's
    first = run(parked, prompt, 8)
    run(parked, fork, 4)
    back = prompt + first.answer_ids + [5, 6]
    handler.restores.clear()
    warm = run(parked, back, 8)
    out["old_branch_restore"] = dict(zip(("tier", "tokens", "ms"), handler.restores[-1])) \
        if handler.restores else None
    cold = Generator(TorchEngine(model, ctx_size=ctx + 32, device=device), tok, GeneratorSettings())
    out["old_branch_cached"] = warm.cached_tokens
    out["old_branch_matches_cold"] = warm.answer_ids == run(cold, back, 8).answer_ids
    logging.getLogger("redlite.parking").removeHandler(handler)
    return out


def scenario(model, device: str, vocab: int, helds: list[int], answer: int, new: int = 18) -> dict:
    """Issue 16's six requests: two conversations (``helds`` tokens after their first answer,
    sharing a 64-token system prompt), each answered, regenerated (sampled) and continued
    (its answer re-rendered without its last 2 tokens + ``new`` tokens). Returns each
    request's TTFT and park line, and the pool afterwards against whole copies of its entries."""
    tok, handler = ByteTokenizer(), ParkLog()
    engine = TorchEngine(model, ctx_size=max(helds) + 2 * answer + new + 64, device=device)
    gen = Generator(engine, tok, GeneratorSettings())
    gen.parking = fresh_parking()
    logging.getLogger("redlite.parking").addHandler(handler)
    system = [(i * 40503) % (vocab - 10) for i in range(64)]
    requests = []
    for n, held in enumerate(helds):
        prompt = system + [(i * 2654435761 + n) % (vocab - 10) for i in range(held - answer - 64)]
        turns = [("answer", prompt, SamplingParams(temperature=0.0)),
                 ("regenerate", prompt, SamplingParams(temperature=1.0, seed=n))]
        for name, ids, sampling in turns:
            handler.parks.clear()
            request = GenerationRequest(list(ids), max_tokens=answer, sampling=sampling)
            result = list(gen.run(request))[-1]
            requests.append({"held": held, "request": name, "ttft_ms": result.ttft_ms,
                             "cached": result.cached_tokens, "park": handler.parks[-1] if handler.parks else None})
            if name == "regenerate":
                second = prompt + result.answer_ids[:-2] + [(7 * i + 3) % (vocab - 10) for i in range(new)]
                turns.append(("second turn", second, SamplingParams(temperature=0.0)))
    logging.getLogger("redlite.parking").removeHandler(handler)
    pool = gen.parking.pool
    whole = sum(engine.range_nbytes(0, len(e.held_ids)) for e in pool.entries())
    return {"requests": requests, "pool_entries": len(pool), "pool_bytes": pool.nbytes,
            "pool_host_bytes": pool.host_nbytes, "pool_device_bytes": pool.device_nbytes,
            "whole_copies_bytes": whole}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--suffix", type=int, default=16, help="prompt tokens a fork changes")
    parser.add_argument("--answer", type=int, default=32, help="answer tokens before the fork")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--machine", default=platform.machine() + "-cpu")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default; 1 on a CPU shared with others)")
    parser.add_argument("--scenario", default="6400,900",
                        help="held sizes of issue 16's six-request scenario ('' to skip)")
    parser.add_argument("--scenario-answer", type=int, default=256, help="answer tokens there")
    parser.add_argument("--out", default=None, help="directory for fork-DATE-MACHINE.{md,json}")
    args = parser.parse_args()
    command = "PYTHONPATH=src python bench/fork.py " + " ".join(sys.argv[1:])
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    helds = [int(s) for s in args.scenario.split(",") if s]
    model = build(args.shape, args.device, max(sizes + helds) + 2 * args.scenario_answer + 128)
    vocab = SHAPES[args.shape][5]
    load = [os.getloadavg()[0]]
    rows = [measure(model, args.device, n, args.suffix, args.answer, args.repeat, vocab) for n in sizes]
    six = scenario(model, args.device, vocab, helds, args.scenario_answer) if helds else None
    load.append(os.getloadavg()[0])
    cores = os.cpu_count()
    lines = [f"# fork cost, {args.shape} llama shape on {args.device} ({datetime.date.today()}, "
             f"{args.machine})", "", f"`{command}`", "",
             f"Load average {load[0]:.1f} at the start, {load[1]:.1f} at the end ({cores} cores): "
             "on a loaded CPU the TTFTs are noisy; park ms is the parking itself, select ms all that "
             "forking adds to the request (candidates, parking, restoring).", "",
             "| held | request | tail tok | tail bytes | tier | whole bytes | whole capture ms | park ms "
             "| select ms | TTFT ms | ideal ms | excess ms | <= 5 ms |", "|---" * 13 + "|"]
    for row in rows:
        for name in ("regenerate", "fork"):
            r = row[name]
            lines.append(f"| {row['held']} | {name} | {r['tail_tokens']} | {r['tail_bytes']} | {r['tier']} "
                         f"| {r['whole_bytes']} | {r['whole_capture_ms']:.1f} | {r['park_ms']:.1f} "
                         f"| {r['select_ms']:.1f} "
                         f"| {r['ttft_ms']:.1f} | {r['ideal_ms']:.1f} | {r['excess_ms']:.1f} "
                         f"| {'yes' if r['excess_ms'] <= 5.0 else 'no'} |")
    lines.append("")
    for row in rows:
        restore = row["old_branch_restore"]
        how = f" from {restore['tier']} in {restore['ms']:.1f} ms" if restore else ""
        lines.append(f"old branch at {row['held']}: restored {row['old_branch_cached']} tok{how}, greedy "
                     f"tokens {'identical to' if row['old_branch_matches_cold'] else 'DIFFERENT from'} "
                     "a cold engine")
    if six is not None:
        lines += ["", "Issue 16's six requests (two conversations: answer, regenerate, second turn):", "",
                  "| held | request | cached tok | TTFT ms | parked tok | bytes | tier | park ms |",
                  "|---" * 8 + "|"]
        for r in six["requests"]:
            park = r["park"] or (0, 0, 0.0, "-")
            lines.append(f"| {r['held']} | {r['request']} | {r['cached']} | {r['ttft_ms']:.1f} | {park[0]} "
                         f"| {park[1]} | {park[3]} | {park[2]:.1f} |")
        lines += ["", f"Pool after them: {six['pool_entries']} entries, {six['pool_bytes'] / 1e6:.1f} MB "
                  f"({six['pool_device_bytes'] / 1e6:.1f} MB on the device); whole copies of the same "
                  f"conversations: {six['whole_copies_bytes'] / 1e6:.1f} MB."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        stem = Path(args.out) / f"fork-{datetime.date.today()}-{args.machine}"
        stem.with_suffix(".md").write_text(text + "\n")
        stem.with_suffix(".json").write_text(json.dumps(
            {"command": command, "date": str(datetime.date.today()), "machine": args.machine,
             "load_average": load, "cores": cores,
             "shape": args.shape, "device": args.device, "rows": rows, "scenario": six},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
