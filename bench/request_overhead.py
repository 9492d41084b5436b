"""The server's own per-request cost for a fork (regenerate) and a second turn, with an engine
that costs almost nothing: what a TTFT adds on top of the engine's prefill.

A real ``redlite serve`` process (uvicorn, h11, the torch engine on CPU) serves a tiny random
Llama (2 layers of 64) with the bundled SmolLM2 tokenizer and chat template, so the HTTP body,
pydantic validation, the Jinja render, tokenizing, exact replay, the reuse planner, placement,
parking and SSE are the ones a user's request goes through. Per held size H (``--held``): a new
conversation of about H tokens (bench/serve_gpu.py's text), then ``--reps`` rounds of

* regenerate: the same messages again (rewind, prefill 1 token; the old answer is parked);
* second turn: the answer + a new user message of ~20 tokens (new in every round, from its
  first word on). From the second round on the server takes the previous round's parked
  branch, which shares the answer's end-of-turn markup with it (a ~40-token tail restored,
  a rewind to the first differing token): ~20 tokens prefilled, as in bench/serve_gpu.py.

Each request is streamed over one keep-alive connection (``max_tokens`` 8, greedy). The server
runs with timing wrappers around its stages (bench/request_overhead_trace.py: the library code
is unchanged); every stamp is ``time.perf_counter`` (CLOCK_MONOTONIC, the client's clock too) and,
for stages that run on one thread, that thread's CPU time. Per case, medians over the rounds:
client TTFT (request sent -> the chunk of the first token), the engine's part (prefill, rewind,
sampling the first token) and the rest, the server's overhead, split into stages.

Usage: PYTHONPATH=src python bench/request_overhead.py [--held 1024,8192,32768] [--reps 15]
    [--src DIR] [--out bench/results --tag NAME]   # writes request-overhead-DATE-TAG.{md,json}

``--src``: the redlite sources the server runs (default this checkout's ``src``); e.g.
``git archive COMMIT src | tar -x -C /tmp/base`` and ``--src /tmp/base/src`` for a before/after.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from request_overhead_trace import ENGINE  # noqa: E402
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def build_model(work: Path, ctx: int, tokenizer: str | None = None) -> Path:
    """A tiny random Llama with the bundled model's tokenizer files (and chat template), or
    those in the folder ``tokenizer``."""
    import torch
    import transformers

    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx,
        eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(work)
    source = Path(tokenizer) if tokenizer else resolve_model_dir(bundled_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, work / name)
    return work


def words(n_tokens: int, seed: int) -> str:
    """bench/serve_gpu.py's text of about ``n_tokens`` tokens (distinct per seed)."""
    import random

    rng = random.Random(seed)
    vocab = ["alpha", "river", "stone", "quiet", "number", "light", "garden", "ship", "window", "orbit"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(int(n_tokens / 2.9)))


def question(r: int) -> str:
    """A ~20-token user message whose first word differs per round (so no parked second turn
    shares more than the answer with the next one: each second turn extends the live state)."""
    return f"{QUESTION_WORDS[r % len(QUESTION_WORDS)]}: which detail matters most here, and why? Answer briefly."


QUESTION_WORDS = ["Reader", "Quickly", "Honestly", "Please", "Now", "Tell", "Explain", "Consider", "Briefly",
                  "Summarize", "Given", "Think", "Okay", "Then", "Finally", "Again", "Listen", "Look", "So", "Well"]


def chat(conn, messages: list[dict], max_tokens: int = 8) -> dict:
    """One streamed chat request over ``conn`` (an ``http.client`` connection, or an
    ``httpx.Client`` used as bench/serve_gpu.py does): send time (the JSON body encoded
    before it), the first token's chunk time, text, usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    data = json.dumps(body, ensure_ascii=False).encode()  # the client's work, before the clock
    if not isinstance(conn, http.client.HTTPConnection):
        sent = time.perf_counter()
        with conn.stream("POST", "/v1/chat/completions", content=data,
                         headers={"content-type": "application/json"}) as response:
            return _read_stream(sent, (line.encode() for line in response.iter_lines()))
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    out = _read_stream(sent, iter(response.readline, b""))
    response.read()
    return out


def _read_stream(sent: float, lines) -> dict:
    chunks, first, usage, text = 0, None, {}, []
    for line in lines:
        if not line.startswith(b"data: {"):
            continue
        chunks += 1
        if chunks == 2:
            first = time.perf_counter()
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            text.append(choice["delta"].get("content") or "")
    return {"sent": sent, "first": first, "text": "".join(text), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def _span(stamps: dict, label: str, which: int = 0) -> tuple[float, float] | None:
    got = stamps.get(label) or []
    return (got[which][0], got[which][1]) if len(got) > which else None


def _total(stamps: dict, label: str, cpu: bool = False) -> float:
    return sum((s[2] if cpu else s[1] - s[0]) for s in stamps.get(label, []) if s[1] is not None)


def breakdown(res: dict, stamps: dict) -> dict:
    """ms per stage of one request (see the module docstring); gaps are thread hand-offs and
    the unlabelled code between stages."""
    ms = lambda a, b: 1e3 * (b - a)  # noqa: E731
    s = {k: _span(stamps, k) for k in ("recv", "body", "validate", "chat_request_of", "prepare", "submit",
                                        "job", "execute")}
    sse_first = _span(stamps, "sse", 1)
    sample = _span(stamps, "sample")
    out = {"ttft": ms(res["sent"], res["first"])}
    engine = sum(1e3 * _total(stamps, k) for k in ENGINE if k != "sample") + (ms(*sample) if sample else 0.0)
    out["engine"] = engine
    out["overhead"] = out["ttft"] - engine
    engine_cpu = sum(1e3 * _total(stamps, k, cpu=True) for k in ENGINE if k != "sample") + \
        1e3 * (stamps["sample"][0][2] if "sample" in stamps else 0.0)
    first_out = _span(stamps, "event_output")
    out["overhead_cpu"] = 1e3 * (stamps["event_output"][0][2] - stamps["recv"][0][2]) - engine_cpu \
        if first_out else float("nan")
    out["http_in"] = ms(res["sent"], s["recv"][0])
    out["body"] = ms(s["recv"][0], s["body"][0])
    out["hop_validate"] = ms(s["body"][0], s["validate"][0])
    out["validate"] = ms(*s["validate"])
    out["hop_chat_request"] = ms(s["validate"][1], s["chat_request_of"][0])
    out["chat_request_of"] = ms(*s["chat_request_of"])
    out["hop_prepare"] = ms(s["chat_request_of"][1], s["prepare"][0])
    out["prepare"] = ms(*s["prepare"])
    for k in ("jinja", "tokenize", "message_ends", "replay_find", "min_tokens", "protect"):
        out["prepare." + k] = 1e3 * _total(stamps, k)
    out["prepare_cpu"] = 1e3 * _total(stamps, "prepare", cpu=True)
    out["prepare_to_submit"] = ms(s["prepare"][1], s["submit"][0])
    out["hop_worker"] = ms(s["submit"][1], s["job"][0])
    out["job_to_execute"] = ms(s["job"][0], s["execute"][0])
    out["job.plan"] = 1e3 * _total(stamps, "plan")
    out["job.select"] = 1e3 * _total(stamps, "select")
    out["select_cpu"] = 1e3 * _total(stamps, "select", cpu=True)
    out["execute"] = ms(*s["execute"])
    out["execute.park"] = 1e3 * _total(stamps, "park")
    for k in ("restore", "split_points", "checkpoint", "checkpoint_add"):
        out["execute." + k] = 1e3 * _total(stamps, k)
    out["settle"] = 1e3 * _total(stamps, "settle")
    out["execute_to_token"] = ms(s["execute"][1], sample[1]) if sample else float("nan")
    out["token_to_sse"] = ms(sample[1], sse_first[0]) if sample and sse_first else float("nan")
    out["sse_to_client"] = ms(sse_first[0], res["first"]) if sse_first else float("nan")
    out["record_turn"] = 1e3 * _total(stamps, "record_turn")
    return out


def shape_model(work: Path, ctx: int, args) -> Path:
    """bench/serve_gpu.py's random-weight model ``args.shape`` (e.g. ``8b``), written to ``work``."""
    from serve_gpu import build_dir

    from redlite.loading.tokenizer import load_tokenizer

    tok_dir = Path(args.tokenizer) if args.tokenizer else None
    if tok_dir is None:
        from redlite.loading.bundled import bundled_model_path
        from redlite.loading.gguf import resolve_model_dir
        tok_dir = Path(resolve_model_dir(bundled_model_path()))
    tokenizer = load_tokenizer(tok_dir)
    config = tok_dir / "config.json"
    vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else len(tokenizer.tokenizer)
    model_dir, model = build_dir(args.shape, tok_dir, work, tokenizer.eos_token_ids, vocab, ctx)
    del model
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model_dir


def run(args) -> dict:
    ctx = int(max(args.held) * 1.1) + 4096
    work = Path(tempfile.mkdtemp(prefix="request-overhead-"))
    cached = Path(args.model_cache) / args.shape if args.shape and args.model_cache else None
    if cached is not None and (cached / "config.json").is_file():
        model = cached  # built by an earlier run with the same --model-cache
    elif args.shape:
        model = shape_model(Path(args.model_cache) if args.model_cache else work, ctx, args)
    else:
        model = build_model(work / "model", ctx, args.tokenizer)
    trace = work / "trace.jsonl"
    port = _free_port()
    profile = ["--profile", str(Path(args.profile).resolve())] if args.profile else []
    command = [sys.executable, str(Path(__file__).with_name("request_overhead_trace.py")), *profile, str(trace), "serve",
               "--engine", "torch", "--model", str(model), "--device", "cpu", "--ctx-size", str(ctx),
               "--port", str(port), *args.server_arg]
    # one engine thread: the tiny model gains nothing from more, and idle OpenMP threads spinning
    # after each step would take the cores the server's own threads are measured on
    path = os.pathsep.join(filter(None, [str(Path(args.src).resolve()), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    cases: dict[str, list[dict]] = {}
    try:
        _wait_ready(port, proc, work / "server.log")
        if args.client == "httpx":
            import httpx
            conn = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        seen = 0
        for held in args.held:
            first = [{"role": "user", "content": words(held, seed=100 + held)}]
            new = chat(conn, first, 8)
            for r in range(args.reps):
                regen = chat(conn, first, 8)
                turn2 = first + [{"role": "assistant", "content": regen["text"]},
                                 {"role": "user", "content": question(r)}]
                second = chat(conn, turn2, 8)
                for case, res in (("regenerate", regen), ("second turn", second)):
                    cases.setdefault(f"{held}/{case}", []).append(res)
            print(f"held {held}: new conversation {new['prompt_tokens']} tok; "
                  f"regenerate cached {regen['cached_tokens']}/{regen['prompt_tokens']}, "
                  f"second turn cached {second['cached_tokens']}/{second['prompt_tokens']}", flush=True)
        conn.close()
        time.sleep(0.2)
        records = [json.loads(line) for line in trace.read_text().splitlines()]
        if args.keep_trace:
            shutil.copy(trace, args.keep_trace)
    finally:
        proc.terminate()
        proc.wait(60)
    # the records are in request order: per held size one new conversation, then the rounds
    per_held = 1 + 2 * args.reps
    out = {}
    for i, held in enumerate(args.held):
        chunk = records[i * per_held:(i + 1) * per_held]
        for case, offset in (("regenerate", 1), ("second turn", 2)):
            results = cases[f"{held}/{case}"]
            rows = [breakdown(res, chunk[offset + 2 * r]) for r, res in enumerate(results)]
            rows = rows[args.skip:]
            out[f"{held}/{case}"] = {
                "held": held, "case": case, "prompt_tokens": results[-1]["prompt_tokens"],
                "cached_tokens": results[-1]["cached_tokens"], "rounds": len(rows),
                "median_ms": {k: statistics.median(r[k] for r in rows) for k in rows[0]},
                "min_ms": {k: min(r[k] for r in rows) for k in rows[0]}}
    shutil.rmtree(work, ignore_errors=True)
    return out


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + log.read_text())
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("server did not start:\n" + log.read_text())


ROWS = [("ttft", "client TTFT (sent -> first token's chunk)"), ("engine", "engine: prefill + rewind + first sample"),
        ("overhead", "**server overhead** (TTFT - engine)"),
        ("overhead_cpu", "**server CPU time**, all threads, app called -> first token handed over, less the engine's"),
        ("http_in", "client send -> app called (h11)"),
        ("body", "body read"), ("hop_validate", "hop to a thread"), ("validate", "pydantic validation"),
        ("hop_chat_request", "hop to a thread"), ("chat_request_of", "ChatRequest built"),
        ("hop_prepare", "hop to a thread"), ("prepare", "prepare (render + tokenize)"),
        ("prepare.jinja", "  jinja render(s)"), ("prepare.tokenize", "  tokenize"),
        ("prepare.message_ends", "  message boundaries (when read: after the first token on an engine that rewinds)"), ("prepare.replay_find", "  replay store look-ups"),
        ("prepare.min_tokens", "  min tokens bound"), ("prepare.protect", "  special-text protection"),
        ("prepare_cpu", "prepare, thread CPU time"), ("prepare_to_submit", "prepare -> queued (the same thread)"),
        ("hop_worker", "queued -> worker runs the job"), ("job_to_execute", "job start -> plan executed (select, plan)"),
        ("job.plan", "  reuse plans"), ("job.select", "  candidate selection (placement)"),
        ("select_cpu", "candidate selection, thread CPU time"),
        ("execute", "execute (park + rewind + prefill)"), ("execute.park", "  parking the cut tail"),
        ("execute.restore", "  checkpoint restored (hybrid)"),
        ("execute.split_points", "  prefill split points (hybrid: reads the message boundaries)"),
        ("execute.checkpoint", "  checkpoint taken (hybrid)"), ("execute.checkpoint_add", "  checkpoint stored (hybrid)"),
        ("settle", "parking bookkeeping (Parker.settle: once the first token is held, after the TTFT)"),
        ("execute_to_token", "first token sampled"), ("token_to_sse", "token -> its SSE chunk written"),
        ("sse_to_client", "SSE chunk -> client"), ("record_turn", "replay record (after the answer)")]


def markdown(result: dict) -> str:
    m = result["meta"]
    keys = list(result["cases"])
    lines = [f"# Server overhead per request, {m['date']}, {m['machine']}", "",
             f"Command: `{m['command']}`", "", f"Bench at commit {m['commit']}, server from {m.get('src')}; "
             f"{m['cpus']} CPUs, load average "
             f"{m['load_average']}; medians of {m['rounds']} rounds (first {m['skip']} dropped), ms.", "",
             "| stage | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    lines.append("| prompt tok (cached) | " + " | ".join(
        f"{result['cases'][k]['prompt_tokens']} ({result['cases'][k]['cached_tokens']})" for k in keys) + " |")
    for key, name in ROWS:
        lines.append(f"| {name} | " + " | ".join(f"{result['cases'][k]['median_ms'][key]:.2f}" for k in keys) + " |")
    lines += ["", "Stages are wall time on the thread that runs them (on an otherwise idle core: per-core "
              "time); 'thread CPU time' rows are that thread's CPU time; 'server CPU time' is the process's "
              "CPU time (every thread) from the app's call to the first token's hand-over to the event "
              "loop, less the engine's (prefill, rewind, first sample): per-core time, insensitive to other "
              "load on the machine. Hops: from one stage's end to the next one's start on another thread "
              "(to_thread, the worker's queue, call_soon_threadsafe)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held", default="1024,8192,32768")
    parser.add_argument("--reps", type=int, default=15, help="rounds per held size")
    parser.add_argument("--skip", type=int, default=2, help="first rounds left out of the medians")
    parser.add_argument("--server-arg", action="append", default=[], help="extra server option")
    parser.add_argument("--src", default=str(ROOT / "src"),
                        help="the redlite sources the server runs (e.g. an export of another commit)")
    parser.add_argument("--client", choices=["http.client", "httpx"], default="http.client",
                        help="httpx: the client of bench/serve_gpu.py (its own cost is in the TTFT)")
    parser.add_argument("--tokenizer", default=None,
                        help="folder with the tokenizer files (default: the bundled model's)")
    parser.add_argument("--model-cache", default=None,
                        help="with --shape: build the model in this folder once, and serve it from there "
                             "in later runs with the same folder and --held (e.g. to compare --src trees)")
    parser.add_argument("--shape", default=None,
                        help="serve bench/serve_gpu.py's random model of this shape (e.g. 8b) instead of the "
                             "tiny one; pass --server-arg=--device --server-arg=cuda for the GPU")
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep-trace", default=None, help="copy the server's stamps (JSON lines) here")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--profile", default=None,
                        help="write a cProfile (pstats) of the server's prepare, select, plan and execute here")
    args = parser.parse_args()
    args.held = [int(x) for x in args.held.split(",") if x]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "machine": platform.machine() + "-" + args.tag, "cpus": os.cpu_count(), "commit": commit,
            "command": "PYTHONPATH=src python bench/request_overhead.py " + " ".join(sys.argv[1:]),
            "rounds": args.reps, "skip": args.skip, "src": args.src, "client": args.client}
    cases = run(args)
    meta["load_average"] = round(os.getloadavg()[0], 2)
    result = {"meta": meta, "cases": cases}
    text = markdown(result)
    print(text)
    if args.out:
        stem = Path(args.out) / f"request-overhead-{meta['date']}-{args.tag}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
        stem.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
