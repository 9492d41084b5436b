"""Chat rendering cost: render + tokenize time, and what a huge conversation does to others.

With the bundled model's tokenizer and chat template (SmolLM2, ChatML):
1. ``render_chat`` (render, tokenize, message boundaries) for 10, 100, 1,000 and 10,000 tiny
   messages, and for a ~200-message, ~30k-token agent conversation with tool calls and results,
   cold (pieces never tokenized before) and warm (the conversation resent);
2. against a real ``redlite serve`` (torch engine, bundled model, default context): the time until
   each of those conversations is answered (a 400 when it does not fit the context), and the delay
   a small request (``max_tokens`` 1) suffers when sent while the 10,000-message request is being
   handled, against the same small request alone; and the server process's CPU time per
   request (what one request costs everyone else on a quiet machine).
Prints a table and saves JSON under bench/results/ (with the machine's load average: the
figures are only comparable on an otherwise idle machine).

Usage: PYTHONPATH=src .venv/bin/python bench/render.py [--runs 5] [--no-server]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_process import ServerProcess  # noqa: E402

SMALL = [{"role": "user", "content": "Say hi."}]


def tiny(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(n)]


def agent_conversation(turns: int = 66) -> list[dict]:
    """A coding-agent transcript (~200 messages, ~30k tokens with the bundled tokenizer):
    system prompt, task, then per turn an assistant message calling a tool (OpenAI
    ``tool_calls``, its text also in the content since the bundled template ignores the
    field), the tool's result (source text) and a short assistant comment."""
    code = "\n".join(f"def handler_{k}(request, retries=3):\n    return process(request, k={k})"
                     for k in range(15))
    messages = [{"role": "system", "content": "You are a coding agent. Use the tools to read and "
                 "edit files. " * 20},
                {"role": "user", "content": "The tests in tests/test_api.py fail; find and fix the bug."}]
    for t in range(turns):
        arguments = json.dumps({"path": f"src/module_{t}.py"})
        call = {"id": f"call_{t}", "type": "function",
                "function": {"name": "read_file", "arguments": arguments}}
        messages.append({"role": "assistant", "tool_calls": [call],
                         "content": f'<tool_call>\n{{"name": "read_file", "arguments": {arguments}}}\n</tool_call>'})
        messages.append({"role": "tool", "tool_call_id": f"call_{t}", "content": f"# src/module_{t}.py\n{code}"})
        messages.append({"role": "assistant", "content": f"module_{t} looks fine; the handlers "
                         "pass their retries through. Next file."})
    return messages


def time_render(tokenizer, messages: list[dict], runs: int) -> dict:
    """render_chat (render, tokenize, message boundaries): median ms with an empty piece cache
    (``cold``: a conversation never seen) and with the pieces cached (``warm``: an agent
    resending its conversation with one more turn)."""
    from redlite.loading.segment_encoder import SegmentEncoder
    times: dict[str, list[float]] = {"cold_ms": [], "warm_ms": [], "cold_cpu_ms": [], "warm_cpu_ms": []}
    rendered = None
    for _ in range(runs):
        tokenizer._segments = SegmentEncoder(tokenizer._backend)
        for kind in ("cold", "warm"):
            started, cpu = time.perf_counter(), time.process_time()
            rendered = tokenizer.render_chat(messages)
            _ = rendered.message_ends  # computed on first read
            times[f"{kind}_ms"].append((time.perf_counter() - started) * 1000)
            times[f"{kind}_cpu_ms"].append((time.process_time() - cpu) * 1000)
    return {"messages": len(messages), "tokens": len(rendered.token_ids),
            "message_ends": len(rendered.message_ends),
            **{key: statistics.median(values) for key, values in times.items()}}


def post(url: str, messages: list[dict] | bytes, **fields) -> tuple[int, float]:
    """POST a chat request; ``messages`` may be a body already encoded (so a client thread
    sending a huge body does not hold this process's GIL while another one is timed)."""
    if isinstance(messages, bytes):
        content = messages
    else:
        content = json.dumps({"messages": messages, "temperature": 0, **fields}).encode()
    started = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=120)
    return r.status_code, (time.perf_counter() - started) * 1000


def cpu_ms(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far, in ms (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def server_figures(cases: dict, runs: int) -> dict:
    out: dict = {"answered_ms": {}}
    with ServerProcess(engine="torch", timeout_s=300) as server:
        post(server.url, SMALL, max_tokens=1)  # warm-up
        for name, messages in cases.items():
            body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 1}).encode()
            before = cpu_ms(server.proc.pid)
            results = [post(server.url, body) for _ in range(runs)]
            out["answered_ms"][name] = {"status": results[0][0],
                                        "ms": statistics.median(ms for _, ms in results),
                                        "server_cpu_ms": (cpu_ms(server.proc.pid) - before) / runs}
        alone = statistics.median(post(server.url, SMALL, max_tokens=1)[1] for _ in range(runs))
        big_body = json.dumps({"messages": cases["10000 tiny"], "temperature": 0}).encode()
        delays, overlapped = [], 0
        for _ in range(runs):
            big_done: list[float] = []
            big = threading.Thread(target=lambda: (post(server.url, big_body),
                                                   big_done.append(time.perf_counter())))
            big.start()
            time.sleep(0.01)  # the big request is being sent, parsed and checked
            sent = time.perf_counter()
            delays.append(post(server.url, SMALL, max_tokens=1)[1] - alone)
            big.join()
            overlapped += big_done[0] > sent  # the big one was still being handled
        out["small_alone_ms"] = alone
        out["small_delay_ms"] = statistics.median(delays)
        out["small_delay_max_ms"] = max(delays)
        out["small_overlapped_runs"] = overlapped
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-server", action="store_true", help="only the in-process timings")
    args = parser.parse_args()

    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolve_model_dir(bundled_model_path()))

    cases = {f"{n} tiny": tiny(n) for n in (10, 100, 1000, 10000)}
    cases["agent"] = agent_conversation()
    render = {}
    print(f"load average {os.getloadavg()[0]:.1f}; wall ms (CPU ms of the process: the work "
          "itself, whatever else runs)")
    print(f"{'conversation':>14} {'messages':>8} {'tokens':>7} {'ends':>5} {'cold':>16} {'warm':>16}")
    for name, messages in cases.items():
        row = render[name] = time_render(tokenizer, messages, args.runs)
        print(f"{name:>14} {row['messages']:>8} {row['tokens']:>7} {row['message_ends']:>5} "
              f"{row['cold_ms']:>7.1f} ({row['cold_cpu_ms']:>6.1f}) {row['warm_ms']:>7.1f} "
              f"({row['warm_cpu_ms']:>6.1f})")
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
              "load_average_1min": os.getloadavg()[0], "runs": args.runs, "render": render}
    if not args.no_server:
        figures = server_figures(cases, args.runs)
        result["server"] = figures
        for name, answer in figures["answered_ms"].items():
            print(f"server: {name:>10} answered {answer['status']} in {answer['ms']:.1f} ms "
                  f"(server CPU {answer['server_cpu_ms']:.1f} ms per request)")
        print(f"server: small request alone {figures['small_alone_ms']:.1f} ms; delayed by "
              f"{figures['small_delay_ms']:.1f} ms (max {figures['small_delay_max_ms']:.1f}) while "
              f"the 10,000-message request is handled (overlapping in {figures['small_overlapped_runs']} "
              f"of {args.runs} runs)")
    out = ROOT / "bench" / "results" / f"render-{result['date']}-{platform.machine()}-cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
