"""Forced calls end on the bundled SmolLM2 model (greedy), the agent trial's cases: its
template does not render tools, so the grammar alone writes the calls. Before the fix, a
named function whose schema does not forbid extra keys ran to ``max_tokens`` inventing keys
(``{", ": 1000...``) and ``tool_choice: "required"`` did the same or repeated the call; now the
objects are closed and the answer ends after its calls (a repeated call ends it)."""

from __future__ import annotations

import json

import pytest

from redlite.core.chat import OutputEvent
from redlite.core.constraints import MAX_FORCED_CALLS, build_constraint
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.core.output_scanner import ParseOptions
from redlite.engine.base import SamplingParams

pytestmark = pytest.mark.model

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                            "parameters": {"type": "object", "properties": {
                                                "command": {"type": "string"}, "timeout": {"type": "integer"}},
                                                "required": ["command"]}}},
         {"type": "function", "function": {"name": "read_file", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"}}}}}]
KEYS = {"bash": {"command", "timeout"}, "read_file": {"path"}}


@pytest.fixture(scope="module")
def generator():
    from redlite.engine.factory import load_engine

    engine, tokenizer = load_engine(None, ctx_size=1024)
    return Generator(engine, tokenizer)


def run(generator, messages, tool_choice, max_tokens=160):
    spec = build_constraint(None, TOOLS, tool_choice, "hermes")
    prompt = generator.tokenizer.render_chat(messages).token_ids
    request = GenerationRequest(prompt, max_tokens, SamplingParams(temperature=0, constraint=spec),
                                parse=ParseOptions(tool_format="hermes"))
    items = list(generator.run(request))
    result = items[-1]
    assert isinstance(result, GenerationResult)
    text = "".join(i.value for i in items if isinstance(i, OutputEvent) and i.kind == "content")
    return result.output, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("messages, tool_choice", [
    ([{"role": "system", "content": "You are a coding agent. Use the tools."},
      {"role": "user", "content": "List the files in the repo and then read README.md"}], "required"),
    ([{"role": "user", "content": "hi"}], "read_file"),
    ([{"role": "user", "content": "hi"}], "required"),
], ids=["agent-required", "hi-read_file", "hi-required"])
def test_forced_calls_end(generator, messages, tool_choice):
    output, text = run(generator, messages, tool_choice)
    assert output.finish_reason == "tool_calls", (output, text)
    assert 1 <= len(output.tool_calls) <= MAX_FORCED_CALLS
    for call in output.tool_calls:
        assert set(json.loads(call.arguments)) <= KEYS[call.name], call
