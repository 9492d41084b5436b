"""Parking speed on the bundled model: save and restore a conversation, RAM and disk.

For conversations of 1k, 4k and 8k tokens (the first tokens of bench/fixtures/long_context.txt,
prefilled into the torch engine in-process), measures:

- RAM save: ``capture`` (engine snapshot to host memory, checkpoints included);
- RAM restore: ``install`` (engine state, held ids, checkpoints back);
- disk save: ``SessionStore.save`` (safetensors + JSON, CRC-32, temporary file, fsync, rename);
- disk restore: ``SessionStore.load`` (read, verify: "read+verify") + ``install``, with the
  file dropped from the page cache first (``posix_fadvise(DONTNEED)`` after its fsync), so the
  read is the disk's;
- the disk's own sequential write (fsync included) and cold read of as many bytes, in the same
  directory right after each repetition, for comparison;
- the prefill time of the same tokens (what a restore saves).

GB/s = state bytes / time (1 GB = 1e9 bytes). Prints a table and saves JSON under
bench/results/.

Usage: .venv/bin/python bench/park.py [--sizes 1024,4096,8192] [--dir DIR] [--repeat 3]
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

from redlite.core.conversations import capture, install  # noqa: E402
from redlite.core.generation import Generator, GeneratorSettings  # noqa: E402
from redlite.core.sessions import SessionStore, expected_for  # noqa: E402


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_speed(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write s, cold read s) of ``nbytes`` sequential bytes with fsync, 8 MiB blocks."""
    path = directory / "raw-speed.bin"
    block = os.urandom(8 << 20)
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    drop_cache(path)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(8 << 20)
        while f.readinto(buffer):
            pass
    read_s = time.perf_counter() - started
    path.unlink()
    return write_s, read_s


def measure(gen: Generator, store: SessionStore, tokens: list[int], repeat: int) -> dict:
    engine = gen.engine
    engine.reset()
    gen.held_ids, gen.failed = [], False
    gen.checkpoints.clear()
    started = time.perf_counter()
    engine.prefill(tokens)
    prefill_s = time.perf_counter() - started
    gen.held_ids = list(tokens)
    times: dict[str, list[float]] = {k: [] for k in ("ram_save", "ram_restore", "disk_save", "disk_read",
                                                     "disk_restore", "raw_write", "raw_read")}
    nbytes = file_bytes = 0
    for _ in range(repeat):
        t = time.perf_counter()
        entry = capture(gen, "bench", time.time())
        times["ram_save"].append(time.perf_counter() - t)
        nbytes = entry.snapshot.nbytes
        engine.reset()
        t = time.perf_counter()
        assert install(gen, entry)
        times["ram_restore"].append(time.perf_counter() - t)
        t = time.perf_counter()
        saved = store.save(entry)
        times["disk_save"].append(time.perf_counter() - t)
        assert saved is not None
        file_bytes = saved.nbytes
        drop_cache(saved.path)
        engine.reset()
        t = time.perf_counter()
        loaded = store.load(saved.key)
        times["disk_read"].append(time.perf_counter() - t)
        assert loaded is not None and install(gen, loaded)
        times["disk_restore"].append(time.perf_counter() - t)
        assert gen.held_ids == tokens and engine.n_past == len(tokens)
        store._delete(saved.key, "bench")
        write_s, read_s = disk_speed(store.directory, file_bytes)  # the disk itself, same moment
        times["raw_write"].append(write_s)
        times["raw_read"].append(read_s)
    row = {"tokens": len(tokens), "state_bytes": nbytes, "file_bytes": file_bytes, "prefill_s": prefill_s}
    for name, values in times.items():
        row[f"{name}_s"] = statistics.median(values)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir under bench/results)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

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
            rows.append(measure(gen, store, ids[:n], args.repeat))
            print(f"measured {n} tokens", file=sys.stderr)

    gb = 1e9
    print(f"\nbundled model {engine.model_id}, dtype {str(engine.dtype).removeprefix('torch.')}, "
          f"CPU, {os.cpu_count()} cores; median of {args.repeat}; disk dir {base}\n")
    print("| tokens | state MB | prefill s | RAM save ms (GB/s) | RAM restore ms (GB/s) | "
          "disk save ms (GB/s) | disk read+verify ms (GB/s) | disk restore ms (GB/s) | "
          "raw disk write GB/s | raw disk read GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = r["state_bytes"]

        def cell(key: str) -> str:
            return f"{r[key] * 1e3:.1f} ({b / r[key] / gb:.2f})"
        print(f"| {r['tokens']} | {b / 1e6:.1f} | {r['prefill_s']:.2f} | {cell('ram_save_s')} | "
              f"{cell('ram_restore_s')} | {cell('disk_save_s')} | {cell('disk_read_s')} | "
              f"{cell('disk_restore_s')} | {r['file_bytes'] / r['raw_write_s'] / gb:.2f} | "
              f"{r['file_bytes'] / r['raw_read_s'] / gb:.2f} |")
    stamp = datetime.date.today().isoformat()
    out = ROOT / f"bench/results/park-{stamp}-{platform.machine()}-cpu.json"
    out.write_text(json.dumps({"model": engine.model_id, "dtype": str(engine.dtype), "repeat": args.repeat,
                               "rows": rows, "platform": platform.platform()}, indent=2))
    print(f"\nsaved {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
