"""Chat requests rendered through real chat templates (ours, under tests/templates/): history
shapes, the system-merge retry, format detection and forced openings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redlite.core.chat import ChatRequest
from redlite.core.chat_render import (detect_formats, merge_systems, render_request,
                                      template_messages)

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning": "Call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_dir(bundled_model_path()))


def with_template(tokenizer, name):
    tokenizer.chat_template = (TEMPLATES / name).read_text()
    return tokenizer


def test_template_messages_shapes():
    shaped = template_messages(HISTORY)
    assistant = shaped[2]
    assert assistant["content"] == "" and assistant["reasoning_content"] == "Call the tool."
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert "reasoning" not in assistant and HISTORY[2]["content"] is None  # inputs untouched


def test_qwen3_template_renders_calls_results_and_reasoning(hf_tokenizer):
    tok = with_template(hf_tokenizer, "qwen3_tools.jinja")
    text = render_request(tok, ChatRequest(HISTORY, tools=TOOLS)).text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<think>\nCall the tool.\n</think>\n<tool_call>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert json.dumps(TOOLS[0]) in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert detect_formats(tok.chat_template_source) == ("hermes", "qwen3")


def test_several_system_messages_are_merged_when_the_template_refuses_them(hf_tokenizer, caplog):
    tok = with_template(hf_tokenizer, "qwen3_tools.jinja")
    messages = [HISTORY[0], {"role": "user", "content": "hi"}, {"role": "system", "content": "Later."}]
    with pytest.raises(Exception):
        tok.render_chat(template_messages(messages))
    text = render_request(tok, ChatRequest(messages)).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\nLater.<|im_end|>")
    assert merge_systems(messages)[1] == {"role": "user", "content": "hi"}


def test_llama3_template_and_detection(hf_tokenizer):
    tok = with_template(hf_tokenizer, "llama3_tools.jinja")
    text = render_request(tok, ChatRequest(HISTORY, tools=TOOLS)).text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in text
    assert detect_formats(tok.chat_template_source) == ("llama3_json", None)


def test_detection_of_qwen3_coder_markup():
    source = "{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' }} <think>"
    assert detect_formats(source) == ("qwen3_coder", "qwen3")
    assert detect_formats(None) == ("hermes", None)
