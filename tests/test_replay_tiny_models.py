"""Exact replay's mismatch classes on a KV model and a hybrid model, in process: a tiny random
Llama (KV cache, rewinds) and a tiny random Qwen3.5 (recurrent state: checkpoints only), both
with the bundled SmolLM2 tokenizer and our Qwen3-style template (tests/templates).

A random model writes a call only under a forced ``tool_choice`` (the grammar writes the
arguments in the schema's order: ``path`` before ``content``) and reasons only because the
prompt opens ``<think>`` and it never closes it. Per class, turn 2 must be a plain extension
(``cached_tokens`` = everything turn 1 left held) with exact replay, a miss with ``--replay
template`` (so the test can fail), and give the same prompt and answer as a cold server
(``--no-reuse``) that ran the same turns. Main agent + sub-agent, interleaved with their
session keys: the main agent's state survives only by parking (on the hybrid it cannot be cut
back either); its cached tokens cover its whole previous turn every time.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.model

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_tools.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
WRITE = {"type": "function", "function": {"name": "write", "description": "Write a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "minLength": 2, "maxLength": 8},
                                     "content": {"type": "string", "minLength": 2, "maxLength": 12}},
    "required": ["path", "content"], "additionalProperties": False}}}
SYSTEM = {"role": "system", "content": "You are a tiny random model that edits files."}
NO_THINKING = {"enable_thinking": False}
# like Qwen3's own templates: reasoning of turns before the last user message is dropped
DROPPING = TEMPLATE.read_text().replace("{%- if loop.index0 > ns.last_user or message.reasoning_content -%}",
                                        "{%- if loop.index0 > ns.last_user -%}")
assert DROPPING != TEMPLATE.read_text()


def _model(kind: str):
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(config)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=4096, eos_token_id=2, tie_word_embeddings=True)
    return transformers.Qwen3_5ForCausalLM(config)


def build_model_dir(kind: str, tmp_path_factory) -> Path:
    """A tiny random model (``llama`` or ``qwen3_5``) with the SmolLM2 tokenizer and our template."""
    import torch

    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-{kind}-replay")
    _model(kind).eval().save_pretrained(path)
    source = resolve_model_dir(bundled_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    shutil.copy(TEMPLATE, path / "chat_template.jinja")
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    return build_model_dir(request.param, tmp_path_factory)


@contextlib.contextmanager
def server(path: Path, *, reuse: bool = True, replay: str = "exact", park: bool = False,
           template: str | None = None):
    """An in-process server on the model (its own engine; ``client.state``); ``park``: a RAM
    pool for parking; ``template``: another chat template."""
    from redlite.core.conversations import Conversations
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GeneratorSettings
    from redlite.core.parking import ParkingPool
    from redlite.core.worker import EngineWorker
    from redlite.engine.factory import load_engine
    from redlite.server.app import ServerState, create_app
    from redlite.server.chat_service import ChatOptions

    engine, tokenizer = load_engine(str(path), ctx_size=2048, device="cpu")
    if template is not None:
        tokenizer.chat_template = template
    generator = Generator(engine, tokenizer, GeneratorSettings(reuse=reuse, checkpoint_interval=0))
    if park:
        generator.parking = Conversations(ParkingPool(64 << 20, 8), None)
    worker = EngineWorker(generator)
    state = ServerState(worker, tokenizer, "tiny", engine.max_context,
                        chat_options=ChatOptions(replay=replay))
    try:
        with TestClient(create_app(state), base_url="http://127.0.0.1") as client:
            client.state = state
            yield client
    finally:
        worker.shutdown(wait_s=5.0)


def ask(client, messages, headers=None, **fields):
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, **fields}
    r = client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    # held: prompt + answer, less the last token when max_tokens cut it (not fed back)
    held = usage["prompt_tokens"] + usage["completion_tokens"] - (out["choices"][0]["finish_reason"] == "length")
    return out["choices"][0]["message"], usage, held


def sorted_keys(message):
    return {"role": "assistant", "content": message.get("content") or "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.dumps(
            json.loads(c["function"]["arguments"]), sort_keys=True, separators=(",", ":"))}}
        for c in message["tool_calls"]]}


def without_ids(message):
    return {**message, "tool_calls": [c["function"] for c in message.get("tool_calls") or []]}


def session(client, case):
    """Turn 1, then turn 2 with turn 1's answer in the client's form: (held after turn 1,
    turn-2 usage, turn-2 answer, turn-1 answer)."""
    first = [SYSTEM, {"role": "user", "content": "Write a file, then tell me about it."}]
    if case == "sorted-keys":
        fields = {"tools": [WRITE], "chat_template_kwargs": NO_THINKING}
        answer, _, held = ask(client, first, tool_choice={"type": "function", "function": {"name": "write"}},
                              max_tokens=60, **fields)
        assert answer["tool_calls"], answer
        arguments = json.loads(answer["tool_calls"][0]["function"]["arguments"])
        assert list(arguments) == ["path", "content"]  # as generated: not sorted
        second = first + [sorted_keys(answer), {"role": "tool", "content": "written",
                                                "tool_call_id": answer["tool_calls"][0]["id"]}]
    else:  # the prompt opens <think>: a sampled answer that is all reasoning (max_tokens)
        fields = {}
        answer, _, held = ask(client, first, temperature=1.0, seed=3, **fields)
        assert answer.get("reasoning_content"), answer
        back = {"role": "assistant", "content": answer.get("content") or ""}  # reasoning stripped
        if case == "reasoning-dropped-by-template":  # sent back, but the template drops it
            back["reasoning_content"] = answer["reasoning_content"]
        second = first + [back, {"role": "user", "content": "And now?"}]
    answer2, usage2, _ = ask(client, second, **fields)
    return held, usage2, answer2, answer


@pytest.mark.parametrize("case", ["sorted-keys", "reasoning-stripped", "reasoning-dropped-by-template"])
def test_mismatch_class_is_a_plain_extension_and_equals_cold(model_dir, case):
    template = DROPPING if case == "reasoning-dropped-by-template" else None
    with server(model_dir, template=template) as warm:
        held, usage, answer2, answer1 = session(warm, case)
    assert usage["prompt_tokens_details"]["cached_tokens"] == held, (case, usage, held)
    with server(model_dir, reuse=False, template=template) as cold:
        _, cold_usage, cold_answer2, cold_answer1 = session(cold, case)
    assert without_ids(cold_answer1) == without_ids(answer1) and cold_answer2 == answer2
    assert cold_usage["prompt_tokens"] == usage["prompt_tokens"]
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    with server(model_dir, replay="template", template=template) as plain:
        t_held, t_usage, _, _ = session(plain, case)
    assert t_usage["prompt_tokens_details"]["cached_tokens"] < t_held  # the template alone misses
    print(case, "exact cached", usage["prompt_tokens_details"]["cached_tokens"], "of", held,
          "| template cached", t_usage["prompt_tokens_details"]["cached_tokens"], "of", t_held)


def test_main_and_sub_agent_interleaved(model_dir):
    main_system = {"role": "system", "content": "You are the main agent. " + "Plan well. " * 20}
    sub_system = {"role": "system", "content": "You are a sub-agent that searches. " + "Find. " * 20}
    histories = {"main": [main_system], "sub": [sub_system]}
    headers = {"main": {"session_id": "main-1"}, "sub": {"x-session-affinity": "sub-7"}}
    previous: dict[str, int] = {}
    with server(model_dir, park=True) as warm:
        for turn in range(3):
            for agent in ("main", "sub"):
                history = histories[agent]
                history.append({"role": "user", "content": f"{agent} step {turn}: go on."})
                answer, usage, held = ask(warm, history, headers[agent],
                                          chat_template_kwargs=NO_THINKING)
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                if agent in previous:  # the whole previous turn kept: parked and restored
                    assert cached >= previous[agent], (agent, turn, cached, previous[agent])
                previous[agent] = held
                history.append({"role": "assistant", "content": answer.get("content") or ""})
        # every turn after the first two switched conversations: restored from the RAM pool
        assert 'redlite_restore_seconds_count{tier="ram"} 4.0' in warm.get("/metrics").text


@pytest.mark.parametrize("case", ["trimmed", "regenerate"])
def test_trimmed_and_regenerated_keep_what_they_can(model_dir, case):
    """Not exact replay's (nothing to recognise): a trimmed answer renders through the template
    and keeps the common prefix (KV) or the checkpoint before the generation prompt (hybrid);
    a regenerate keeps all but the last prompt token (KV: its logits) or the whole prompt
    (hybrid: the checkpoint at its end holds them). Answers equal a cold server's."""
    from redlite.core.reuse import common_prefix_length

    hybrid = "qwen3_5" in model_dir.name
    first = [SYSTEM, {"role": "user", "content": "Tell me about files."}]

    def run(client):
        answer, usage1, _ = ask(client, first, temperature=1.0, seed=5, max_tokens=12,
                                chat_template_kwargs=NO_THINKING)
        if case == "regenerate":
            again, usage, _ = ask(client, first, temperature=1.0, seed=5, max_tokens=12,
                                  chat_template_kwargs=NO_THINKING)
            return usage1, usage, again, answer, first
        text = answer.get("content") or ""
        trimmed = first + [{"role": "assistant", "content": text[: len(text) // 2]},
                           {"role": "user", "content": "Go on."}]
        got, usage, _ = ask(client, trimmed, chat_template_kwargs=NO_THINKING)
        return usage1, usage, got, answer, trimmed

    with server(model_dir) as warm:
        usage1, usage, answer2, answer1, second = run(warm)
        tokenizer = warm.state.tokenizer
    with server(model_dir, reuse=False) as cold:
        _, cold_usage, cold_answer2, cold_answer1, _ = run(cold)
    assert (cold_answer1, cold_answer2) == (answer1, answer2)
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    cached, prompt1 = usage["prompt_tokens_details"]["cached_tokens"], usage1["prompt_tokens"]
    if case == "regenerate":
        assert answer2 == answer1 and cached == (prompt1 if hybrid else prompt1 - 1)
    else:
        rendered = tokenizer.render_chat(first, enable_thinking=False)
        common = common_prefix_length(rendered.token_ids, tokenizer.render_chat(
            second, enable_thinking=False).token_ids)
        assert common < prompt1  # the history's header differs from the generation prompt
        assert cached == (rendered.message_ends[-1] if hybrid else common), (cached, common)
