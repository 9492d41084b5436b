"""Generate the scripted agent traces of ``bench/traces/`` (deterministic from a seed).

    python bench/make_traces.py            # rewrites bench/traces/*.json

A trace is a client's requests as templates (issue 15, "bench/agent.py: agent traces replayed"):

    {"name", "wire": "chat" | "anthropic" | "responses", "seed",
     "client": {"strip_reasoning", "sort_keys", "aider", "temperature"},
     "system", "tools": [OpenAI function tools], "sessions": {NAME: {headers, body}},
     "turns": [{"session": NAME, "add": [MESSAGE | {"role": "tool", "results": [str, ...]}],
                "edit_previous_user": str | null, "file_block": str | null, "nonce": str | null}]}

At replay (:mod:`agent_replay`) each session's history grows by the model's actual answer (in
the client's form) and then by ``add``; a ``tool`` entry's results answer the previous answer's
calls in order. The echo engine answers with the last user or tool message, so that message
carries the scripted next answer (``<tool_call>`` text for a call, ``<think>`` for reasoning).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("buffer cache token session parser engine request stream worker plan prefix model "
         "value index layer config result error handler state").split()


def tool(name: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()},
                       "required": list(props)}}}


TOOLS = [tool("read_file", path="string", limit="integer"), tool("bash", command="string", timeout="integer"),
         tool("edit_file", path="string", old="string", new="string"), tool("task", prompt="string")]


def call(name: str, arguments: dict) -> str:
    """A hermes call as the byte template renders it back (json.dumps, default separators)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def source_file(rng: random.Random, size: int) -> str:
    """Python-looking text of about ``size`` bytes."""
    lines = []
    while sum(len(x) + 1 for x in lines) < size:
        a, b, c = rng.sample(WORDS, 3)
        lines.append(rng.choice([f"def {a}_{b}(self, {c}):", f"    {a} = self.{b}.get({c!r})",
                                 f"    return {a}_{c} + {rng.randint(0, 999)}", f"# {a} {b} {c}", ""]))
    return "\n".join(lines)


def command_output(rng: random.Random, size: int) -> str:
    lines = []
    while sum(len(x) + 1 for x in lines) < size:
        lines.append(f"tests/test_{rng.choice(WORDS)}.py::{rng.choice(WORDS)} PASSED [{rng.randint(1, 99)}%]")
    return "\n".join(lines)


def scripted(rng: random.Random, think: bool, calls: list[tuple[str, dict]], text: str = "") -> str:
    """The next answer's exact text (what the echo engine repeats)."""
    thought = " ".join(f"I should check the {' '.join(rng.sample(WORDS, 6))}." for _ in range(rng.randint(3, 10)))
    head = f"<think>\n{thought}\n</think>\n\n" if think else ""
    return head + text + "\n".join(call(n, a) for n, a in calls)


def random_calls(rng: random.Random, parallel: bool) -> list[tuple[str, dict]]:
    count = rng.choice([2, 3]) if parallel else 1
    out = []
    for _ in range(count):
        path = f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py"
        out.append(rng.choice([("read_file", {"path": path, "limit": 400}),
                               ("bash", {"command": f"pytest -q tests -k {rng.choice(WORDS)}", "timeout": 60})]))
    return out


def results_for(rng: random.Random, calls: list[tuple[str, dict]], think: bool, next_calls: list[tuple[str, dict]],
                text: str = "") -> dict:
    """Tool results of realistic size; the last one is the scripted next answer (for a single
    call, that answer's text holds the file read, so the echo engine repeats it)."""
    results = [source_file(rng, rng.randint(2048, 8192)) if name == "read_file"
               else command_output(rng, rng.randint(300, 1500)) for name, _ in calls]
    if len(results) == 1:
        text = results[0] + "\n" + text
    results[-1] = scripted(rng, think, next_calls, text)
    return {"role": "tool", "results": results}


def tool_session(rng: random.Random, n_turns: int, think: bool, parallel: bool, session: str = "main") -> list[dict]:
    """A tool loop: a user task, then calls and results; every 8th turn a new user message."""
    calls = random_calls(rng, parallel)
    turns = [{"session": session, "add": [{"role": "user", "content": scripted(rng, think, calls)}]}]
    for i in range(1, n_turns):
        next_calls = random_calls(rng, parallel and i % 3 != 0)
        if i % 8 == 0:  # the answer is text; the user follows up
            turns.append({"session": session, "add": [results_for(rng, calls, think, [], "Done: tests pass.")]})
            turns.append({"session": session, "add": [{"role": "user", "content": scripted(rng, think, next_calls)}]})
        else:
            turns.append({"session": session, "add": [results_for(rng, calls, think, next_calls)]})
        calls = next_calls
    return turns[:n_turns]


def trace(name: str, wire: str, seed: int, turns: list[dict], **client) -> dict:
    return {"name": name, "wire": wire, "seed": seed,
            "client": {"strip_reasoning": False, "sort_keys": False, "aider": False, "temperature": None, **client},
            "system": f"You are {name}, a coding agent. Use the tools to inspect and change the repository.\n" * 8,
            "tools": [] if client.get("aider") else TOOLS, "sessions": {}, "turns": turns}


def interleaved(seed: int) -> dict:
    rng = random.Random(seed)
    main, sub = tool_session(rng, 24, True, True), tool_session(rng, 10, False, False, "sub")
    turns = main[:6] + sub[:5] + main[6:14] + sub[5:] + main[14:]
    t = trace("chat-subagent-parallel", "chat", seed, turns)
    t["sessions"] = {"main": {"headers": {"session_id": "main-7f3a"}, "body": {"prompt_cache_key": "main-7f3a"}},
                     "sub": {"headers": {"session_id": "sub-19c2"}, "body": {"prompt_cache_key": "sub-19c2"}}}
    return t


def aider(seed: int) -> dict:
    rng = random.Random(seed)
    files = source_file(rng, 4000)
    turns = []
    for i in range(26):
        answer = f"Change {i}: rename `{rng.choice(WORDS)}` to `{rng.choice(WORDS)}` in the {rng.choice(WORDS)} module."
        turns.append({"session": "main", "add": [{"role": "user", "content": answer}],
                      "file_block": f"I have *added these files to the chat*:\n\nsrc/app.py\n```\n{files}\n```",
                      "edit_previous_user": "(request already applied)" if i else None})
    return trace("aider-file-block", "chat", seed, turns, aider=True, temperature=1.0)


def build(seed: int) -> list[dict]:
    nonce = random.Random(seed + 3)
    anthropic = trace("anthropic-billing-nonce", "anthropic", seed + 3, tool_session(random.Random(seed + 3), 26, True, True))
    for turn in anthropic["turns"]:
        turn["nonce"] = f"x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch={nonce.getrandbits(40):010x};"
    anthropic["sessions"] = {"main": {"headers": {"X-Claude-Code-Session-Id": "cc-0b5d"}, "body": {}}}
    responses = trace("responses-codex", "responses", seed + 4, tool_session(random.Random(seed + 4), 26, False, True),
                      temperature=1.0)
    responses["sessions"] = {"main": {"headers": {"session_id": "codex-44e1"}, "body": {"prompt_cache_key": "codex-44e1"}}}
    return [interleaved(seed),
            trace("chat-strip-reasoning", "chat", seed + 1, tool_session(random.Random(seed + 1), 26, True, False),
                  strip_reasoning=True),
            trace("chat-sorted-keys", "chat", seed + 2, tool_session(random.Random(seed + 2), 26, False, True),
                  sort_keys=True),
            anthropic, responses, aider(seed + 5)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "traces")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for t in build(args.seed):
        (args.out / f"{t['name']}.json").write_text(json.dumps(t, indent=1) + "\n", encoding="utf-8")
        print(f"{t['name']}: {len(t['turns'])} turns")


if __name__ == "__main__":
    main()
