"""Tool calling on a tiny random model (transformers Llama, random weights, the bundled SmolLM2
tokenizer) with our Qwen3-style template (tests/templates/qwen3_tools.jinja), in process.

A random model writes a call only because ``tool_choice: "required"`` makes the sampler's grammar
force one (hermes markup, arguments valid for the tool's schema); its argument *values* are
arbitrary. The template re-renders a call exactly as the grammar writes it (``tojson`` with
", " / ": " separators) and renders the empty think block that thinking-off prompts end with,
so each turn is a plain extension: cached_tokens >= the previous prompt + the generated call.
Where a template cannot (a random model writes ``"count": -0``, which any JSON round trip
renders as ``0``; hence ``minimum: 1`` here, and ``maximum: 9`` so it cannot write digits forever) the planner rewinds to the difference and the log
says so; keeping such turns is issue 15's exact replay.
The openai client (streamed and not) and the Agents SDK drive the loop."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Literal

import openai
import pytest

from inprocess import async_client, inprocess_app

pytestmark = pytest.mark.model

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_tools.jinja"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
                                                    "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["word", "count"], "additionalProperties": False}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import torch
    import transformers

    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-llama-tools")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    source = resolve_model_dir(bundled_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    shutil.copy(TEMPLATE, path / "chat_template.jinja")
    return path


@pytest.fixture(scope="module")
def app(tiny_dir):
    from redlite.engine.factory import load_engine

    engine, tokenizer = load_engine(str(tiny_dir), ctx_size=4096, device="cpu")
    with inprocess_app(engine, tokenizer, model_id="tiny") as (app, state):
        assert (state.chat.tool_format, state.chat.reasoning_format) == ("hermes", "qwen3")
        yield app


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 240))


@pytest.mark.parametrize("stream", [False, True])
def test_three_forced_tool_turns_extend_the_held_state(app, stream):
    from test_tools_echo import ask

    async def main():
        client = openai.AsyncOpenAI(base_url="http://redlite/v1", api_key="x", http_client=async_client(app))
        messages = [{"role": "system", "content": "You look words up."},
                    {"role": "user", "content": "Look up three words."}]
        previous, figures = None, []
        for turn in range(3):
            message, finish, usage = await ask(client, messages, stream, tools=[LOOKUP],
                                               tool_choice="required", max_tokens=80,
                                               parallel_tool_calls=False,
                                               temperature=0, extra_body=NO_THINKING)
            assert finish == "tool_calls", message
            [call] = message["tool_calls"]
            arguments = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == "lookup" and set(arguments) == {"word", "count"}
            assert isinstance(arguments["count"], int) and isinstance(arguments["word"], str)
            cached = usage.prompt_tokens_details.cached_tokens
            figures.append((usage.prompt_tokens, cached, usage.completion_tokens))
            if previous is not None:
                assert cached >= previous[0] and cached > previous[1], figures
            previous = (usage.prompt_tokens, cached)
            messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": f"meaning {turn}"}]
        print("turns (prompt, cached, generated):", figures)
    run(main())


def test_agents_sdk_loop_on_the_tiny_model(app):
    import agents

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def lookup(word: Literal["cat", "dog", "emu"]) -> str:
        """Look a word up (an enum: a random model would write a free string until max_tokens)."""
        calls.append(word)
        return f"{word!r} is a word."

    async def main():
        client = openai.AsyncOpenAI(base_url="http://redlite/v1", api_key="x", http_client=async_client(app))
        model = agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)
        settings = agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0,
                                        parallel_tool_calls=False, extra_body=NO_THINKING)
        agent = agents.Agent(name="words", instructions="Look words up.", tools=[lookup],
                             model=model, model_settings=settings,
                             tool_use_behavior="stop_on_first_tool")
        result = await agents.Runner.run(agent, "Look up a word.")
        return result.final_output

    output = run(main())
    assert len(calls) == 1 and output == f"{calls[0]!r} is a word."
