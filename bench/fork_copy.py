"""Fork by copy under ``--parallel`` (issue 20): prompt tokens reused and TTFT of requests that
share a long prefix with another slot's conversation but less than half of it.

In process, on the bundled SmolLM2 (or ``--model``), greedy: conversation A (a long system
prompt, two turns), then B (A's first answer edited), C (a new conversation with A's system
prompt) and A's third turn, served by ``--parallel 4`` and by ``--parallel 1`` (one slot: A is
cut and parked, then restored). Printed and written (md + json): per request and setting, the
prompt and cached tokens and the TTFT, plus the copy times from the ``copied`` log lines.

Usage: PYTHONPATH=src .venv/bin/python bench/fork_copy.py [--model PATH] [--device cpu|cuda]
       [--out DIR] [--machine NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from redlite.core.conversations import Conversations  # noqa: E402
from redlite.core.generation import Generator  # noqa: E402
from redlite.core.generation_request import GenerationRequest, GeneratorSettings  # noqa: E402
from redlite.core.parking import ParkingPool  # noqa: E402
from redlite.core.scheduler import build_scheduler  # noqa: E402
from redlite.core.worker import EngineWorker, Job  # noqa: E402
from redlite.engine.base import SamplingParams  # noqa: E402
from redlite.engine.factory import load_engine  # noqa: E402

SYSTEM = {"role": "system", "content": "You are a careful assistant for a team of engineers. " * 8}
FIRST = {"role": "user", "content": "What is a file system? Answer in two sentences."}
NAMES = ("a1", "a2", "b", "c", "a3")


def messages(name: str, answers: dict) -> list[dict]:
    a2 = [SYSTEM, FIRST, {"role": "assistant", "content": answers.get("a1", "")},
          {"role": "user", "content": "Now explain journaling. " + "Be precise about the order of writes. " * 10}]
    return {"a1": [SYSTEM, FIRST], "a2": a2,
            "b": [SYSTEM, FIRST, {"role": "assistant", "content": answers.get("a1", "")[:20] + " (edited)"},
                  {"role": "user", "content": "Then say what an inode is. " * 6}],
            "c": [SYSTEM, {"role": "user", "content": "Name three rivers in Europe. " * 4}],
            "a3": a2 + [{"role": "assistant", "content": answers.get("a2", "")},
                        {"role": "user", "content": "Thanks. One more sentence?"}]}[name]


class CopyLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.copies: list[tuple[int, float]] = []

    def emit(self, record):
        m = re.search(r"copied (\d+) tok from slot \d+ in ([\d.]+) ms", record.getMessage())
        if m:
            self.copies.append((int(m[1]), float(m[2])))


def serve(engine, tokenizer, parallel: int) -> list[dict]:
    engine.reset()
    generator = Generator(engine, tokenizer, GeneratorSettings(prefill_chunk=256))
    generator.parking = Conversations(ParkingPool(256 << 20, 8), None)
    worker = build_scheduler(generator, parallel, 8) if parallel > 1 else EngineWorker(generator, 8)
    answers, rows = {}, []
    try:
        for name in NAMES:
            rendered = tokenizer.render_chat(messages(name, answers))
            events: list = []
            job = Job(GenerationRequest(rendered.token_ids, max_tokens=48, sampling=SamplingParams(temperature=0),
                                        message_ends=rendered.message_ends, request_id=name), events.append)
            worker.submit(job)
            assert job.finished.wait(600), name
            result = next(e.value for e in events if e.kind == "done")
            answers[name] = "".join(e.value.value for e in events if e.kind == "output")
            rows.append({"request": name, "parallel": parallel, "prompt_tokens": result.prompt_tokens,
                         "cached_tokens": result.cached_tokens, "ttft_ms": round(result.ttft_ms, 1),
                         "answer": answers[name]})
    finally:
        worker.shutdown(wait_s=30.0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--machine", default="vm")
    args = parser.parse_args()
    engine, tokenizer = load_engine(args.model, ctx_size=2048, device=args.device)
    copies = CopyLog()
    logging.getLogger("redlite.parking").addHandler(copies)
    logging.getLogger("redlite.parking").setLevel(logging.INFO)
    rows = serve(engine, tokenizer, 4) + serve(engine, tokenizer, 1)
    same = all(a["answer"] == b["answer"] for a, b in zip(rows[:5], rows[5:]))
    lines = ["| request | parallel | prompt tok | cached tok | TTFT ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['request']} | {r['parallel']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_ms']} |"
              for r in rows]
    lines += ["", f"copies under --parallel 4 (tokens, ms): {copies.copies}",
              f"answers the same under --parallel 4 and 1: {same}"]
    print("\n".join(lines))
    stem = f"fork-copy-{datetime.date.today().isoformat()}-{args.machine}"
    command = "PYTHONPATH=src .venv/bin/python bench/fork_copy.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    (out / f"{stem}.md").write_text(f"# Fork by copy under --parallel\n\n`{command}` (model "
                                    f"{engine.model_id}, {args.device})\n\n" + "\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"command": command, "model": engine.model_id, "device": args.device,
                                                  "rows": rows, "copies": copies.copies, "same_answers": same},
                                                 indent=1) + "\n")


if __name__ == "__main__":
    main()
