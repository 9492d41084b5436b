"""Agent traces replayed against a server: how much of each turn's prompt is prefilled again.

    python bench/agent.py --out bench/results              # echo engine on CPU (about one CPU-minute)
    python bench/agent.py --model PATH --out bench/results # a real model
    python bench/agent.py --model bundled --context-limit 4096 --max-tokens 48 --out bench/results

Replays every ``bench/traces/*.json`` (``make_traces.py``) against a ``redlite serve`` it starts
(default reuse; ``--replay template`` when the server has that option; ``--no-reuse``) and
llama.cpp's ``llama-server`` when installed (PATH or ~/.cache/redlite/llama.cpp, same model file;
only with ``--model``). Per turn: prompt tokens, reused, prefilled, new since the previous turn
(tokens the client added or changed, measured on the rendering of the history with the answers
as generated: ``/apply-template`` + ``/tokenize``), miss reason (the server log's ``cache miss ...
reason=``). Per trace: reuse efficiency = sum(new) / sum(prefilled) (1.0 ideal) and the TTFT sum.
Writes ``agent-DATE-MACHINE[-MODEL].{md,json,png}`` to ``--out``.

A small model's context holds only the first turns of a trace: ``--context-limit`` ends a trace
before the first turn whose prompt (rendered and tokenized by the server under test) plus
``--max-tokens`` would pass it; the first server run fixes the turn count every other run of
that trace uses. ``--max-tokens`` caps every answer (``redlite serve --max-tokens``,
``llama-server -n``). ``--model bundled``: the bundled SmolLM2 GGUF file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from agent_replay import Session, answer_of, request_for  # noqa: E402

TRACES = Path(__file__).parent / "traces"
PREFILL = re.compile(r"prefill (\d+) tok \((\d+) cached\) ttft ([\d.]+) ms")
MISS = re.compile(r"cache miss .*reason=([\w-]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (redlite or llama-server) with its log in a temporary file."""

    def __init__(self, command: list[str], port: int, timeout_s: float = 300) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_file = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(command, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        self.offset = 0
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start")
            time.sleep(0.2)

    def read_log(self) -> str:
        with open(self.log_file.name, encoding="utf-8", errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
        self.offset += len(text.encode("utf-8", "replace"))
        return text

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log_file.name)


def redlite_command(args, port: int, extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", "redlite.cli", "serve", "--port", str(port), "--log-level", "info"]
    command += ["--model", args.model] if args.model else ["--engine", "echo"]
    if args.max_tokens:
        command += ["--max-tokens", str(args.max_tokens)]
    if args.ctx_size:
        command += ["--ctx-size", str(args.ctx_size)]
    return command + extra


def llama_command(args, llama: str, port: int) -> list[str]:
    command = [llama, "-m", args.model, "--port", str(port), "--jinja", "-c", str(args.ctx_size or 32768)]
    return command + (["-n", str(args.max_tokens)] if args.max_tokens else [])


def serve_options() -> str:
    out = subprocess.run([sys.executable, "-m", "redlite.cli", "serve", "--help"], capture_output=True, text=True)
    return out.stdout


def find_llama_server() -> str | None:
    found = shutil.which("llama-server")
    if found:
        return found
    for path in sorted((Path.home() / ".cache/redlite/llama.cpp").glob("**/llama-server")):
        if os.access(path, os.X_OK):
            return str(path)
    return None


def render_prompt(client: httpx.Client, messages: list[dict], tools: list[dict]) -> str:
    """The server's chat-template rendering of ``messages`` (``/apply-template``)."""
    body = {"model": "x", "messages": messages, **({"tools": tools} if tools else {})}
    return client.post("/apply-template", json=body).raise_for_status().json()["prompt"]


def count_tokens(client: httpx.Client, text: str) -> int:
    """Tokens of ``text`` by the server's tokenizer (``/tokenize``)."""
    return len(client.post("/tokenize", json={"content": text}).raise_for_status().json()["tokens"])


def new_tokens(client: httpx.Client, previous_ideal: list[dict] | None, ideal: list[dict],
               tools: list[dict]) -> int:
    """Tokens of this turn's prompt (answers as generated) after its common text prefix with the
    previous turn's prompt + answer."""
    def render(messages):
        return render_prompt(client, messages, tools)

    def count(text):
        return count_tokens(client, text)

    prompt = render(ideal)
    if previous_ideal is None:
        return count(prompt)
    common = os.path.commonprefix([prompt, render(previous_ideal)])
    if common.rfind("<|") > common.rfind("|>"):  # the cut is inside a special marker: keep it whole
        common = common[:common.rfind("<|")]
    return count(prompt[len(common):])  # a BPE tokenizer may merge across the cut: +-1 token


def replay(server: Server, trace: dict, model: str, redlite: bool, timeout_s: float = 600,
           max_turns: int | None = None, context_limit: int | None = None,
           max_tokens: int | None = None) -> dict:
    """Run one trace (its first ``max_turns`` turns; none from the first whose prompt + answer
    cap passes ``context_limit`` tokens; answers of at most ``max_tokens``, asked in the
    request); per-turn rows and the trace's figures (``timeout_s`` per HTTP call)."""
    sessions: dict[str, Session] = {}
    previous: dict[str, list[dict]] = {}
    rows = []
    with httpx.Client(base_url=server.url, timeout=timeout_s) as client:
        for index, turn in enumerate(trace["turns"][:max_turns]):
            session = sessions.setdefault(turn["session"], Session(trace))
            sent, ideal = session.next_messages(turn)
            if context_limit and count_tokens(client, render_prompt(client, sent, trace["tools"])) > context_limit:
                break
            path, body, headers = request_for(trace, turn, sent, model)
            for key in ("max_tokens", "max_output_tokens"):  # llama-server's -n yields to these
                if max_tokens and key in body:
                    body[key] = min(body[key], max_tokens)
            started = time.perf_counter()
            response = client.post(path, json=body, headers=headers)
            elapsed_ms = (time.perf_counter() - started) * 1000
            if response.status_code != 200:
                raise RuntimeError(f"{trace['name']} turn {index}: {response.status_code} {response.text[:500]}")
            data = response.json()
            answer = answer_of(trace, data)
            time.sleep(0.02)  # the log line is written before the answer; let it reach the file
            log = server.read_log()
            row = {"turn": index, "session": turn["session"], "miss": "-"}
            if redlite:
                match = PREFILL.findall(log)
                prefilled, cached, ttft = (int(match[-1][0]), int(match[-1][1]), float(match[-1][2])) if match else (0, 0, elapsed_ms)
                misses = MISS.findall(log)
                row["miss"] = misses[-1] if misses else "-"
            else:  # llama-server: its timings object
                timings = data.get("timings", {})
                prefilled, cached, ttft = timings.get("prompt_n", 0), timings.get("cache_n", 0), timings.get("prompt_ms", elapsed_ms)
            row.update(prompt=prefilled + cached, reused=cached, prefilled=prefilled, ttft_ms=round(ttft, 1),
                       new=new_tokens(client, previous.get(turn["session"]), ideal, trace["tools"]))
            rows.append(row)
            session.answered(answer, turn)
            previous[turn["session"]] = ideal + [session.ideal[-1]]
    total_new, total_prefilled = sum(r["new"] for r in rows), sum(r["prefilled"] for r in rows)
    return {"rows": rows, "turns": len(rows), "new": total_new, "prefilled": total_prefilled,
            "reuse_efficiency": round(total_new / total_prefilled, 4) if total_prefilled else None,
            "ttft_sum_ms": round(sum(r["ttft_ms"] for r in rows), 1)}


SERVERS = ("redlite", "redlite --replay template", "redlite --no-reuse", "llama.cpp")


def modes(args) -> list[tuple[str, list[str] | None, str]]:
    """(label, extra serve options or None when n/a, why n/a) of the redlite runs."""
    helptext = serve_options()
    template = ["--replay", "template"] if "--replay" in helptext else None
    return [("redlite", [], ""), ("redlite --replay template", template, "server has no --replay option"),
            ("redlite --no-reuse", ["--no-reuse"], "")]


def run_all(args, traces: list[dict], results: dict | None = None) -> dict:
    """Every run ``args.servers`` names; ``results``: those of an earlier run (``--merge``),
    kept unless run again (their turn counts fix this run's)."""
    results = dict(results or {})
    model = "echo" if not args.model else Path(args.model).name
    turns: dict[str, int] = {}  # turns per trace, fixed by the first run
    for per_trace in results.values():
        for name, r in per_trace.items():
            if isinstance(r, dict) and "turns" in r:
                turns.setdefault(name, r["turns"])
    limit = args.context_limit - (args.max_tokens or 0) if args.context_limit else None

    def run(server, trace, redlite):
        result = replay(server, trace, model, redlite, max_turns=turns.get(trace["name"]),
                        context_limit=limit, max_tokens=args.max_tokens)
        turns.setdefault(trace["name"], result["turns"])
        return result

    for label, extra, why in modes(args):
        if label not in args.servers:
            continue
        if extra is None:
            print(f"{label}: n/a ({why})")
            results[label] = {"n/a": why}
            continue
        port = free_port()
        server = Server(redlite_command(args, port, extra), port)
        try:
            results[label] = {t["name"]: run(server, t, True) for t in traces}
        finally:
            server.stop()
        print_mode(label, results[label], verbose=(label == "redlite"))
    llama = find_llama_server()
    if "llama.cpp" not in args.servers:
        pass
    elif llama is None or not (args.model or "").endswith(".gguf"):
        why = "llama-server not found" if llama is None else "needs --model FILE.gguf"
        print(f"llama.cpp: skipped ({why})")
        results["llama.cpp"] = {"n/a": why}
    else:
        port = free_port()
        server = Server(llama_command(args, llama, port), port)
        try:
            results["llama.cpp"] = {t["name"]: run(server, t, False) for t in traces if t["wire"] == "chat"}
        finally:
            server.stop()
        print_mode("llama.cpp", results["llama.cpp"], verbose=False)
    return results


def print_mode(label: str, per_trace: dict, verbose: bool) -> None:
    print(f"\n== {label}")
    for name, result in per_trace.items():
        if verbose:
            print(f"-- {name}\n turn session  prompt  reused prefilled    new  ttft_ms  miss")
            for r in result["rows"]:
                print(f" {r['turn']:4d} {r['session']:7s} {r['prompt']:7d} {r['reused']:7d} {r['prefilled']:9d} "
                      f"{r['new']:6d} {r['ttft_ms']:8.1f}  {r['miss']}")
        print(f"{name}: {result['turns']} turns, reuse efficiency {result['reuse_efficiency']} (new "
              f"{result['new']} / prefilled {result['prefilled']}), TTFT sum {result['ttft_sum_ms']} ms")


def markdown(results: dict, traces: list[dict], header: str) -> str:
    labels = list(results)
    lines = [header, "", "Reuse efficiency = tokens new since the previous turn / tokens prefilled (1.0 ideal); "
             "TTFT sum in ms. New = tokens of the turn's prompt, rendered with every answer as generated, after "
             "its common prefix with the same session's previous prompt + answer (what the client added or "
             "edited; an answer sent back in another form is not new). Command: `python bench/agent.py --out "
             "bench/results` (options below); traces: `bench/make_traces.py`. TTFT sums are wall times on a "
             "shared machine (2 cores, other jobs running): compare reuse, not time.", "", "| trace | turns | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for t in traces:
        cells = []
        for label in labels:
            r = results[label].get(t["name"])
            cells.append("n/a" if r is None else f"{r['reuse_efficiency']} ({r['ttft_sum_ms']:.0f} ms)")
        run = results[labels[0]].get(t["name"], {}).get("turns", len(t["turns"]))
        count = str(len(t["turns"])) if run == len(t["turns"]) else f"{run} of {len(t['turns'])}"
        lines.append(f"| {t['name']} | {count} | " + " | ".join(cells) + " |")
    for label in labels:
        if "n/a" in results[label]:
            lines.append(f"\n{label}: n/a ({results[label]['n/a']})")
    return "\n".join(lines) + "\n"


def plot(results: dict, traces: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.6 * len(traces)), squeeze=False)
    for ax, t in zip(axes[:, 0], traces):
        rows = results["redlite"][t["name"]]["rows"]
        x = [r["turn"] for r in rows]
        ax.bar(x, [r["reused"] for r in rows], label="cached (reused)", color="tab:green")
        ax.bar(x, [r["prefilled"] for r in rows], bottom=[r["reused"] for r in rows], label="prefilled", color="tab:red")
        ax.plot(x, [r["new"] for r in rows], "k.", label="new since previous turn")
        ax.set_title(f"{t['name']}: reuse efficiency {results['redlite'][t['name']]['reuse_efficiency']}")
        ax.set_ylabel("tokens")
    axes[0, 0].legend(loc="upper left")
    axes[-1, 0].set_xlabel("turn")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model for redlite serve (default: the echo engine; "
                        "'bundled': the bundled SmolLM2 GGUF file)")
    parser.add_argument("--context-limit", type=int, help="end a trace before a turn whose prompt + "
                        "--max-tokens passes this many tokens")
    parser.add_argument("--max-tokens", type=int, help="cap on every answer (server side)")
    parser.add_argument("--ctx-size", type=int, help="context of both servers (tokens)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated runs among {', '.join(SERVERS)}")
    parser.add_argument("--merge", type=Path, help="JSON of an earlier run: its results are kept "
                        "unless run again (e.g. --servers llama.cpp once llama-server is built)")
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--only", help="run only traces whose name contains this")
    parser.add_argument("--out", type=Path, help="folder for agent-DATE-MACHINE.{md,json,png}")
    args = parser.parse_args()
    args.servers = args.servers.split(",")
    if args.model == "bundled":
        from redlite.loading.bundled import bundled_model_path
        args.model = str(bundled_model_path())
    traces = [json.loads(p.read_text()) for p in sorted(args.traces.glob("*.json"))]
    traces = [t for t in traces if not args.only or args.only in t["name"]]
    earlier = json.loads(args.merge.read_text())["results"] if args.merge else None
    results = run_all(args, traces, earlier)
    results = {label: results[label] for label in SERVERS if label in results}
    machine = platform.node().split(".")[0] or "machine"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    engine = f"model {Path(args.model).name} (CPU)" if args.model else "echo engine (CPU)"
    header = f"# Agent traces, {engine}, {date}, {machine} ({platform.processor() or platform.machine()})"
    if args.context_limit or args.max_tokens:
        header += (f"\n\nCommand options: --context-limit {args.context_limit} --max-tokens {args.max_tokens}"
                   f" --ctx-size {args.ctx_size} (a trace runs its first turns that fit; turns column)")
    table = markdown(results, traces, header)
    print("\n" + table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        model = f"-{Path(args.model).stem.replace('.', '-')}" if args.model else ""
        stem = str(args.out / f"agent-{date}-{machine}{model}")
        Path(stem + ".md").write_text(table)
        summary = {label: ({"n/a": r["n/a"]} if "n/a" in r else
                           {name: {"reuse_efficiency": v["reuse_efficiency"], "ttft_sum_ms": v["ttft_sum_ms"],
                                   "turns": v["turns"],
                                   "new": v["new"], "prefilled": v["prefilled"], "rows": v["rows"]}
                            for name, v in r.items()}) for label, r in results.items()}
        Path(stem + ".json").write_text(json.dumps({"engine": engine, "date": date, "machine": machine,
                                                         "results": summary}, indent=1))
        plot(results, traces, Path(stem + ".png"))
        print(f"wrote {stem}.md/.json/.png")


if __name__ == "__main__":
    main()
