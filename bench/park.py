"""Parking speed on the bundled model: save and restore a conversation, RAM and disk, against
the disk's own bandwidth measured in the same run.

For conversations of 1k, 4k and 8k tokens (the first tokens of bench/fixtures/long_context.txt,
prefilled into the torch engine in-process), each repetition measures, interleaved:

- RAM save: ``capture`` (engine snapshot to host memory, checkpoints included);
- RAM restore: ``install`` (engine state, held ids, checkpoints back);
- disk save: ``SessionStore.save`` (safetensors + JSON, XXH3, temporary file, fsync, rename,
  directory fsync) and the raw write of as many bytes from a full-size buffer already in
  memory (as the parked state is) in 8 MiB writes, fsync, to a new file in the same directory
  (each side deletes its previous file just before it writes: with both deleted first, the
  second writer got most of the slow outliers, on a virtual machine whose freed pages are
  reported to the host);
- disk restore, cold: ``SessionStore.load`` + ``install`` (checksum verified while the state
  is read straight into the engine's cache), and the raw read of the same session file in
  8 MiB ``readinto`` calls into a full-size buffer already touched (as the engine's cache is),
  the file dropped from the page cache (``posix_fadvise(DONTNEED)`` after an fsync) just
  before each of the two reads. The raw side thus moves the same bytes, from the same blocks
  of the same file, between the same kinds of memory in the same pattern; only the format,
  the checksum and the bookkeeping differ (a separate raw file read first after the writes ran
  up to 2x slower here than the session file read first, or the reverse, whatever the reader:
  where a file lies on a virtual disk matters). The fraction of the file resident in the page
  cache just before each read is measured (``mincore``) and printed, so the condition is
  shown, not assumed;
- disk restore, warm: the same two reads again with the file left in the page cache
  (resident fraction printed too): what a restore of a file saved moments ago costs;
- the prefill time of the same tokens (what a restore saves).

The orders alternate in a 2 x 2 pattern: ours writes first in even repetitions, the raw
anchor in odd ones; ours reads first in repetitions 0, 1 (mod 4), the raw read in 2, 3. So
``--repeat`` is a multiple of 4, and each side writes first and reads first equally often,
after either write order (on a virtual disk the second of two back-to-back writes often runs
at a fraction of the first's speed, and the first read after the writes ran slower after the
other file's write than after its own).
GB/s = file bytes / median time (1 GB = 1e9 bytes); ``%`` = our GB/s / raw GB/s (target >= 80%
for save and restore, issue 12 §5). Every repetition's time is in the JSON.
Prints a Markdown table (headed by the command line) and saves it with the JSON under
bench/results/ (``park-DATE-MACHINE.{md,json}``); the raw anchor is in bench/park_raw.py.

Usage: PYTHONPATH=src .venv/bin/python bench/park.py [--sizes 1024,4096,8192] [--dir DIR] [--repeat 16]
       [--random-weights] [--random-state] [--machine NAME] [--out DIR]
(``--random-weights``: the bundled model's shape, random weights, no model file; ``--random-state``:
random state bytes instead of a prefill. Neither changes the bytes saved and restored.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from park_raw import drop_cache, full_buffers, raw_read, raw_write, resident  # noqa: E402

from redlite.core.live_state import capture, install  # noqa: E402
from redlite.core.generation import Generator  # noqa: E402
from redlite.core.generation_request import GeneratorSettings  # noqa: E402
from redlite.core.sessions import SessionStore, expected_for  # noqa: E402

# SmolLM2-135M's shape (the bundled model): --random-weights builds it without the model file
SMOLLM2_135M = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True)


def random_engine(ctx: int):
    """A torch engine of the bundled model's shape with random weights (same state size)."""
    import torch

    from redlite.engine.torch_engine import TorchEngine
    from redlite.models.llama import LlamaModel

    model = LlamaModel(dict(SMOLLM2_135M), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    return TorchEngine(model.eval(), ctx_size=ctx, model_id="random-SmolLM2-135M-shape")


def fill_random(engine, n: int) -> None:
    """Hold ``n`` tokens of random state (instead of a prefill)."""
    import torch

    from redlite.engine.base import StateSnapshot

    shapes = {name: t.shape for name, t in engine.snapshot().tensors.items()}
    tensors = {name: torch.randn(*(shape[:3] + (n,) + shape[4:])) for name, shape in shapes.items()}
    engine.restore(StateSnapshot(n, tensors, {}, "torch"))


def measure(gen: Generator, store: SessionStore, tokens: list[int], repeat: int,
            random_state: bool = False) -> dict:
    engine = gen.engine
    engine.reset()
    gen.held_ids, gen.failed = [], False
    gen.checkpoints.clear()
    started = time.perf_counter()
    if random_state:
        fill_random(engine, len(tokens))
        prefill_s = float("nan")
    else:
        engine.prefill(tokens)
        prefill_s = time.perf_counter() - started
    gen.held_ids = list(tokens)
    keys = ("ram_save", "ram_restore", "disk_save", "raw_write", "cold_restore", "cold_raw_read",
            "warm_restore", "warm_raw_read")
    times: dict[str, list[float]] = {k: [] for k in keys}
    residency: dict[str, list[float]] = {k: [] for k in ("cold_session", "cold_raw", "warm_session", "warm_raw")}
    raw_path = store.directory / "raw-speed.bin"
    nbytes = file_bytes = 0
    source = target = None  # full-size raw buffers, made once the file size is known
    saved: list = []  # the session file of the last repetition
    for rep in range(repeat):
        t = time.perf_counter()
        entry = capture(gen, "bench", time.time())
        times["ram_save"].append(time.perf_counter() - t)
        nbytes = entry.snapshot.nbytes
        engine.reset()
        t = time.perf_counter()
        assert install(gen, entry)
        times["ram_restore"].append(time.perf_counter() - t)

        # each side deletes its own last file just before it writes (see above)
        def save() -> None:
            if saved:
                store._delete(saved.pop().key, "bench")
            t = time.perf_counter()
            saved.append(store.save(entry))
            times["disk_save"].append(time.perf_counter() - t)

        def write_raw() -> None:
            raw_path.unlink(missing_ok=True)
            times["raw_write"].append(raw_write(raw_path, source))  # as large as the last save

        first_raw = rep % 2 == 1  # the 2 x 2 order pattern (see above)
        read_raw_first = rep % 4 >= 2
        if first_raw:
            write_raw()
        save()
        file_bytes = saved[0].nbytes
        if source is None:
            source, target = full_buffers(file_bytes)
        if not first_raw:
            write_raw()

        def restore(condition: str) -> None:
            if condition == "cold":
                drop_cache(saved[0].path)
            residency[f"{condition}_session"].append(resident(saved[0].path))
            engine.reset()
            t = time.perf_counter()
            loaded = store.load(saved[0].key)
            assert loaded is not None and install(gen, loaded)
            times[f"{condition}_restore"].append(time.perf_counter() - t)
            assert gen.held_ids == tokens and engine.n_past == len(tokens)

        def read_raw(condition: str) -> None:
            if condition == "cold":
                drop_cache(saved[0].path)
            residency[f"{condition}_raw"].append(resident(saved[0].path))
            times[f"{condition}_raw_read"].append(raw_read(saved[0].path, target))

        for condition in ("cold", "warm"):
            for step in ((read_raw, restore) if read_raw_first else (restore, read_raw)):
                step(condition)
    store._delete(saved[0].key, "bench")
    raw_path.unlink()
    row = {"tokens": len(tokens), "state_bytes": nbytes, "file_bytes": file_bytes, "prefill_s": prefill_s}
    for name, values in times.items():
        row[f"{name}_s"] = statistics.median(values)
        row[f"{name}_each_s"] = values  # in repetition order (the order pattern above)
    for name, values in residency.items():
        row[f"{name}_resident"] = max(values) if name.startswith("cold") else min(values)
    return row


def table(rows: list[dict]) -> list[str]:
    gb = 1e9
    lines = ["| tokens | file MB | prefill s | RAM save ms | RAM restore ms | disk save ms (GB/s) | "
             "raw write GB/s | save % of raw | cold restore ms (GB/s) | cold raw read GB/s | "
             "cold restore % of raw | warm restore ms (GB/s) | warm raw read GB/s | warm restore % of raw |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = r["file_bytes"]

        def bw(key: str) -> float:
            return b / r[key] / gb

        def pct(ours: str, raw: str) -> str:
            return f"{100 * r[raw] / r[ours]:.0f}%"
        lines.append(
            f"| {r['tokens']} | {b / 1e6:.1f} | {r['prefill_s']:.2f} | {r['ram_save_s'] * 1e3:.1f} | "
            f"{r['ram_restore_s'] * 1e3:.1f} | {r['disk_save_s'] * 1e3:.1f} ({bw('disk_save_s'):.2f}) | "
            f"{bw('raw_write_s'):.2f} | {pct('disk_save_s', 'raw_write_s')} | "
            f"{r['cold_restore_s'] * 1e3:.1f} ({bw('cold_restore_s'):.2f}) | {bw('cold_raw_read_s'):.2f} | "
            f"{pct('cold_restore_s', 'cold_raw_read_s')} | "
            f"{r['warm_restore_s'] * 1e3:.1f} ({bw('warm_restore_s'):.2f}) | {bw('warm_raw_read_s'):.2f} | "
            f"{pct('warm_restore_s', 'warm_raw_read_s')} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir under bench/results)")
    parser.add_argument("--repeat", type=int, default=16, help="a multiple of 4 (see the orders above)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=str(ROOT / "bench/results"), help="where the .md/.json go")
    parser.add_argument("--machine", default=None, help="machine name in the output file name")
    parser.add_argument("--random-weights", action="store_true",
                        help="the bundled model's shape with random weights (no model file needed)")
    parser.add_argument("--random-state", action="store_true",
                        help="random state tensors instead of a prefill (same bytes, no prefill time)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.repeat < 4 or args.repeat % 4:
        parser.error("--repeat must be a multiple of 4 (the 2 x 2 order pattern)")

    if args.random_weights:
        from redlite.core.byte_tokenizer import ByteTokenizer

        engine, tokenizer = random_engine(max(sizes)), ByteTokenizer()
        ids = [i % 49152 for i in range(max(sizes))]
    else:
        from redlite.engine.factory import load_engine

        engine, tokenizer = load_engine(args.model, ctx_size=max(sizes), device="cpu")
        text = (ROOT / "bench/fixtures/long_context.txt").read_text()
        ids = tokenizer.encode(text)
        while len(ids) < max(sizes):
            ids += ids
    base = Path(args.dir) if args.dir else ROOT / "bench/results"
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=base, prefix="park-") as directory:
        store = SessionStore(directory, expected_for(engine), min_tokens=1, keep=100)
        store.scan()
        gen = Generator(engine, tokenizer, GeneratorSettings())
        for n in sizes:
            rows.append(measure(gen, store, ids[:n], args.repeat, args.random_state))
            print(f"measured {n} tokens", file=sys.stderr)
        store.close()

    load = os.getloadavg()
    residency = ", ".join(f"{r['tokens']}: cold session/raw {r['cold_session_resident']:.0%}/"
                          f"{r['cold_raw_resident']:.0%}, warm {r['warm_session_resident']:.0%}/"
                          f"{r['warm_raw_resident']:.0%}" for r in rows)
    command = " ".join(["bench/park.py", *sys.argv[1:]])
    lines = [f"`{command}`: model {engine.model_id}, dtype "
             f"{str(engine.dtype).removeprefix('torch.')}, CPU, {os.cpu_count()} cores; medians of "
             f"{args.repeat} (each side first in half of them, for writes and reads); disk dir {base} ({platform.platform()}); load average "
             f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end.", "",
             "Page cache before each read (max over repetitions for cold, min for warm), "
             f"fraction of the file resident: {residency}.", "", *table(rows)]
    print("\n" + "\n".join(lines))
    stamp = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"park-{stamp}-{args.machine or platform.machine() + '-cpu'}"
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps({
        "model": engine.model_id, "dtype": str(engine.dtype), "repeat": args.repeat, "rows": rows,
        "command": command,
        "platform": platform.platform(), "loadavg": load}, indent=2))
    print(f"\nsaved {out / name}.{{md,json}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
