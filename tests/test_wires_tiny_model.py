"""The Anthropic Messages and Responses surfaces on a tiny random Llama model, in process, through
the official SDKs: multi-turn conversations with tool calls and tool results in the history
(rendered by the Qwen3-style test template with tools and <think>, tests/templates), streamed and not, the reused prefix
growing every turn.

The model has random weights and borrows the bundled SmolLM2 tokenizer, so its answers are
arbitrary token streams; re-tokenizing such an answer may not give back the generated ids, and
the generation prompt's final newline may merge with the answer's first characters into one
token. So each turn must reuse the whole previous prompt but at most its last token. Sampling
is at the default temperature 1: greedy decoding of this model repeats a newline, which the
reasoning parser strips to nothing.
"""

import json
import shutil
from pathlib import Path

import anthropic
import openai
import pytest

from sdk_app import _timed_out  # noqa: F401  (SIGALRM handler, see below)

pytestmark = pytest.mark.model

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_tools.jinja").read_text()

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory):
    import signal

    import torch
    import transformers
    from fastapi.testclient import TestClient

    from inprocess import inprocess_app
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.engine.factory import load_engine

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    source = resolve_model_dir(bundled_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    engine, tokenizer = load_engine(str(path), ctx_size=4096, device="cpu")
    signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(300)
    try:
        with inprocess_app(engine, tokenizer, model_id="tiny") as (app, _state):
            with TestClient(app, base_url="http://127.0.0.1") as client:
                yield client
    finally:
        signal.alarm(0)


TOOL_INPUT = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def test_anthropic_sdk_tool_conversation(tiny_app):
    client = anthropic.Anthropic(base_url="http://127.0.0.1", api_key="dummy", http_client=tiny_app,
                                 max_retries=0)
    tools = [{"name": "ls", "description": "list a folder", "input_schema": TOOL_INPUT}]
    messages = [{"role": "user", "content": "List the files."}]
    previous_prompt = None
    for turn in range(3):
        fields = dict(model="tiny", max_tokens=8, system="You are a tiny model.",
                      tools=tools, messages=messages, thinking={"type": "enabled", "budget_tokens": 100})
        if turn == 1:
            with client.messages.stream(**fields) as stream:
                for _ in stream:
                    pass
                message = stream.get_final_message()
        else:
            message = client.messages.create(**fields)
        usage = message.usage
        assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")
        if previous_prompt is not None:
            assert usage.cache_read_input_tokens >= previous_prompt - 1, (turn, usage)
        previous_prompt = usage.input_tokens + usage.cache_read_input_tokens
        # the template opened <think>: the random model's tokens are reasoning
        assert message.content[0].type == "thinking", message
        # the client scripts a call of its own after the model's answer, then returns a result
        messages.append({"role": "assistant", "content": [
            *[b.model_dump(exclude_none=True) for b in message.content if b.type != "tool_use"],
            {"type": "tool_use", "id": f"toolu_{turn}", "name": "ls", "input": {"path": f"dir{turn}"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": f"a{turn}.txt"}]})


def test_responses_sdk_tool_conversation(tiny_app):
    client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="dummy", http_client=tiny_app,
                           max_retries=0)
    tools = [{"type": "function", "name": "ls", "description": "list a folder", "parameters": TOOL_INPUT}]
    items = [{"role": "user", "content": "List the files."}]
    previous_prompt = None
    for turn in range(3):
        fields = dict(model="tiny", max_output_tokens=8, instructions="You are a tiny model.",
                      tools=tools, input=items, store=False, include=["reasoning.encrypted_content"])
        if turn == 1:
            # cut by max_output_tokens, the stream ends with response.incomplete, which the SDK's
            # stream helper does not accumulate (as against OpenAI): read the raw events
            events = list(client.responses.create(stream=True, **fields))
            assert events[-1].type in ("response.incomplete", "response.completed")
            response = events[-1].response
        else:
            response = client.responses.create(**fields)
            assert response.status in ("incomplete", "completed")
        usage = response.usage
        if previous_prompt is not None:
            assert usage.input_tokens_details.cached_tokens >= previous_prompt - 1, (turn, usage)
        previous_prompt = usage.input_tokens
        assert [item.type for item in response.output][:1] == ["reasoning"]
        items += [item.model_dump(exclude_none=True) for item in response.output if item.type != "function_call"]
        items += [{"type": "function_call", "call_id": f"call_{turn}", "name": "ls",
                   "arguments": json.dumps({"path": f"dir{turn}"})},
                  {"type": "function_call_output", "call_id": f"call_{turn}", "output": f"a{turn}.txt"}]
