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
    return engine, tokenizer, tokenizer.chat_template


@contextlib.contextmanager
def server(engine, tokenizer, same_bytes: bool, replay: str = "exact", replay_bytes: int = 0,
           reuse: bool = True):
    """An in-process server on ``engine`` (``client.generator``, ``client.state``); by default
    with no kept turns (``replay_bytes=0``)."""
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GeneratorSettings
    from redlite.core.worker import EngineWorker
    from redlite.server.app import ServerState, create_app
    from redlite.server.chat_service import ChatOptions

    generator = Generator(engine, tokenizer, GeneratorSettings(reuse=reuse, same_bytes=same_bytes))
    worker = EngineWorker(generator)
    state = ServerState(worker, tokenizer, "bundled", engine.max_context,
                        chat_options=ChatOptions(replay=replay, replay_bytes=replay_bytes))
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
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GenerationRequest, GeneratorSettings
    from redlite.core.reuse import common_prefix_length
    from redlite.engine.base import SamplingParams

    engine, tokenizer, bundled_template = bundled
    tokenizer.chat_template = TEMPLATE if case == "tool-call" else bundled_template
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


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def tiny(request, tmp_path_factory):
    """A tiny random KV model (llama) or hybrid (Qwen3.5: checkpoints only) with the SmolLM2
    tokenizer and its template (no think block that history turns would drop)."""
    from test_replay_tiny_models import build_model_dir

    from redlite.engine.factory import load_engine
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer

    engine, tokenizer = load_engine(str(build_model_dir(request.param, tmp_path_factory)),
                                    ctx_size=2048, device="cpu")
    tokenizer.chat_template = load_tokenizer(resolve_model_dir(bundled_model_path())).chat_template
    return engine, tokenizer


def test_random_answer_sent_back_as_text_on_kv_and_hybrid(tiny):
    """A random model often writes tokens its tokenizer would not choose: sent back as text,
    the answer re-tokenizes (the first seed whose answer ends and re-tokenizes is used; checked);
    byte matching keeps every held token on the KV model and on the hybrid (a plain extension,
    no checkpoint restore), and the answer equals a cold generator's on the same ids.
    <|im_end|> is favoured so the answer ends (finish stop: every generated token is held)."""
    from redlite.core.chat import ChatRequest
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GenerationRequest, GeneratorSettings
    from redlite.core.reuse import common_prefix_length
    from redlite.engine.base import SamplingParams

    engine, tokenizer = tiny
    kwargs = NO_THINKING["chat_template_kwargs"]

    def turn_one(client, seed):
        answer, usage1, finish = ask(client, FIRST, temperature=1.0, seed=seed,
                                     logit_bias={"2": 7}, **NO_THINKING)
        second = FIRST + [{"role": "assistant", "content": answer["content"]},
                          {"role": "user", "content": "Go on."}]
        plain = client.state.chat.prepare_sync(ChatRequest(messages=second, template_kwargs=kwargs))
        held = list(client.generator.held_ids)
        retokenized = common_prefix_length(plain.generation.prompt_ids, held) < len(held)
        return second, held, finish == "stop" and retokenized

    cached = {}
    with server(engine, tokenizer, True) as client:
        seed = next((seed for seed in range(1, 16) if turn_one(client, seed)[2]), None)
        assert seed is not None, "no seed gave an answer that ends and re-tokenizes"
    for same_bytes in (True, False):
        with server(engine, tokenizer, same_bytes) as client:
            second, held, _ = turn_one(client, seed)
            answer2, usage2, _ = ask(client, second, temperature=0, max_tokens=6, **NO_THINKING)
            cached[same_bytes] = usage2["prompt_tokens_details"]["cached_tokens"]
            if same_bytes:
                assert cached[True] == len(held), (usage2, len(held))
                prompt2 = client.generator.held_ids[:usage2["prompt_tokens"]]
    cold = Generator(engine, tokenizer, GeneratorSettings(reuse=False))
    result = list(cold.run(GenerationRequest(list(prompt2), max_tokens=6,
                                             sampling=SamplingParams(temperature=0))))[-1]
    assert tokenizer.decode(result.answer_ids) == (answer2.get("content") or "")
    assert cached[False] < cached[True]
    print("rewind" if engine.can_rewind else "hybrid", "seed", seed, "cached", cached[True],
          "of held", len(held), "| without byte matching", cached[False])


def sorted_args(message: dict) -> dict:
    return {**client_copy(message), "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        json.loads(c["function"]["arguments"]), sort_keys=True, separators=(",", ":"))}}
        for c in message["tool_calls"]]}


@pytest.mark.parametrize("mode", ["exact", "template"])
def test_warm_equals_cold_in_both_replay_modes(bundled, mode):
    """Greedy, the bundled model, a forced call sent back with sorted keys then a tool result:
    a warm server and a cold one (``--no-reuse``, the same replay mode, so the same kept turns)
    run the same prompt ids and give the same answers; exact replay keeps every held token,
    the template render does not."""
    engine, tokenizer, _ = bundled
    tokenizer.chat_template = TEMPLATE
    fields = {k: v for k, v in CASES["tool-call"].items() if k != "logit_bias"}
    runs = {}
    for reuse in (True, False):
        with server(engine, tokenizer, mode == "exact", replay=mode, replay_bytes=64 << 20,
                    reuse=reuse) as client:
            answer, _, _ = ask(client, FIRST, **fields)
            held = len(client.generator.held_ids)
            second = FIRST + [sorted_args(answer), {"role": "tool", "content": "written",
                                                    "tool_call_id": answer["tool_calls"][0]["id"]}]
            answer2, usage2, _ = ask(client, second, temperature=0, max_tokens=8, tools=[WRITE],
                                     **NO_THINKING)
            prompt2 = client.generator.held_ids[:usage2["prompt_tokens"]]
            runs[reuse] = (answer["tool_calls"][0]["function"], answer2, prompt2,
                           usage2["prompt_tokens_details"]["cached_tokens"], held)
    warm, cold = runs[True], runs[False]
    assert warm[:3] == cold[:3] and cold[3] == 0
    assert (warm[3] == warm[4]) is (mode == "exact"), (mode, warm[3], warm[4])
