"""Re-tokenized answers on the bundled SmolLM2 (marked ``model``), in process, with the replay
store empty (``replay_bytes=0``: no kept turns), so only byte matching
(:mod:`redlite.core.same_bytes`) can keep the held answer.

The answers are pushed onto a path the tokenizer would not take (``logit_bias`` favours the
pieces ``se`` and ``a``: ``asea`` is written as ``a``, ``se``, ``a``, which the tokenizer
spells otherwise; checked below), greedy
and sampled (the bundled template), and a forced tool call (our Qwen3-style template renders
calls; a tool result follows, so the turn keeps the think block the generation prompt wrote)
whose arguments the client re-serializes. Each answer comes back as text; turn 2 must hold every held token
(``cached_tokens`` = held) while the plain template rendering differs in ids (checked, so the
case is real), and a cold generator given the same prompt ids answers the same. With byte
matching off the same session misses (so the test can fail).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.model

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_tools.jinja").read_text()
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
FIRST = [SYSTEM, {"role": "user", "content": "Write one short sentence about the sea."}]
SEA = {"313": 12, "81": 12, "2": 13}  # the pieces "se" and "a"; <|im_end|>: it stops soon
WRITE = {"type": "function", "function": {"name": "write", "description": "Write a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 12},
                                     "content": {"type": "string", "maxLength": 40}},
    "required": ["path", "content"], "additionalProperties": False}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CASES = {
    "greedy": {"temperature": 0, "logit_bias": SEA, **NO_THINKING},
    "sampled": {"temperature": 1.0, "seed": 3, "logit_bias": SEA, **NO_THINKING},
    "tool-call": {"temperature": 0, "logit_bias": {"313": 12, "81": 12}, "max_tokens": 160, "tools": [WRITE],
                  "tool_choice": {"type": "function", "function": {"name": "write"}}, **NO_THINKING},
}


@pytest.fixture(scope="module")
def bundled():
    from redlite.engine.factory import load_engine

    engine, tokenizer = load_engine(None, ctx_size=2048, device="cpu")
    return engine, tokenizer, tokenizer.transformers_tokenizer.chat_template


@contextlib.contextmanager
def server(engine, tokenizer, same_bytes: bool):
    from redlite.core.generation import Generator, GeneratorSettings
    from redlite.core.worker import EngineWorker
    from redlite.server.app import ServerState, create_app
    from redlite.server.chat_service import ChatOptions

    generator = Generator(engine, tokenizer, GeneratorSettings(same_bytes=same_bytes))
    worker = EngineWorker(generator)
    state = ServerState(worker, tokenizer, "bundled", engine.max_context,
                        chat_options=ChatOptions(replay_bytes=0))
    try:
        with TestClient(create_app(state), base_url="http://127.0.0.1") as client:
            client.generator, client.state = generator, state
            yield client
    finally:
        worker.shutdown(wait_s=5.0)


def ask(client, messages, **fields):
    body = {"model": "bundled", "messages": messages, "max_tokens": 48, **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"], out["usage"], out["choices"][0]["finish_reason"]


def client_copy(message: dict) -> dict:
    """The answer as a client sends it back: text, arguments parsed and dumped again."""
    back = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        back["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
            json.loads(c["function"]["arguments"]))}} for c in message["tool_calls"]]
    return back


def session(client, case):
    """(held ids after turn 1, turn-2 usage, turn-2 prompt ids as run, turn-2 answer, turn
    2's prompt ids as the template renders it)."""
    fields = CASES[case]
    answer, usage1, finish = ask(client, FIRST, **fields)
    if case == "tool-call":
        assert answer.get("tool_calls") and finish == "tool_calls", (answer, finish)
    held = list(client.generator.held_ids)
    if case == "tool-call":
        then = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "written"}
    else:
        then = {"role": "user", "content": "Now the mountains."}
    second = FIRST + [client_copy(answer), then]
    extra = {k: v for k, v in fields.items() if k in ("tools", "chat_template_kwargs")}
    answer2, usage2, _ = ask(client, second, temperature=0, max_tokens=8, **extra)
    prompt2 = client.generator.held_ids[:usage2["prompt_tokens"]]
    from redlite.core.chat import ChatRequest
    request = ChatRequest(messages=second, tools=extra.get("tools", []),
                          template_kwargs=extra.get("chat_template_kwargs", {}))
    plain = client.state.chat.prepare_sync(request).generation.prompt_ids
    return held, usage2, prompt2, answer2, plain


@pytest.mark.parametrize("case", sorted(CASES))
def test_answer_sent_back_as_text_keeps_held_ids_and_equals_cold(bundled, case):
    from redlite.core.generation import GenerationRequest, Generator, GeneratorSettings
    from redlite.core.reuse import common_prefix_length
    from redlite.engine.base import SamplingParams

    engine, tokenizer, bundled_template = bundled
    tokenizer.transformers_tokenizer.chat_template = TEMPLATE if case == "tool-call" else bundled_template
    with server(engine, tokenizer, same_bytes=True) as warm:
        held, usage2, prompt2, answer2, plain = session(warm, case)
    assert usage2["prompt_tokens_details"]["cached_tokens"] == len(held), (case, usage2, len(held))
    assert prompt2[:len(held)] == held
    assert common_prefix_length(plain, held) < len(held)  # the template alone re-tokenizes
    cold = Generator(engine, tokenizer, GeneratorSettings(reuse=False))
    result = list(cold.run(GenerationRequest(list(prompt2), max_tokens=8,
                                             sampling=SamplingParams(temperature=0))))[-1]
    assert tokenizer.decode(result.answer_ids) == (answer2.get("content") or "")
    with server(engine, tokenizer, same_bytes=False) as off:
        held_off, usage_off, _, _, _ = session(off, case)
    assert usage_off["prompt_tokens_details"]["cached_tokens"] < len(held_off)
    print(case, "cached", usage2["prompt_tokens_details"]["cached_tokens"], "of held", len(held),
          "| without byte matching", usage_off["prompt_tokens_details"]["cached_tokens"], "of",
          len(held_off))
