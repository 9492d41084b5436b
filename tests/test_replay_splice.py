"""Splicing kept turns into prompts rendered by a real tokenizer (the bundled SmolLM2's) and
our Qwen3-style template (tests/templates/qwen3_tools.jinja), which renders an earlier turn's
reasoning only when the client sends it: the generated ids (reasoning included, tokenized as
sampled, not as the text re-tokenizes) are kept token for token, the held prompt + answer is a
prefix of every later prompt, and message boundaries map into the spliced ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from redlite.core.chat import ChatRequest
from redlite.core.chat_render import render_request
from redlite.core.replay import GeneratedTurn, ReplayStore, canonical_arguments, context_key
from redlite.core.replay_splice import decode_rendered, render_with_replay

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(bundled_model_path()))
    tokenizer.chat_template = (TEMPLATES / "qwen3_tools.jinja").read_text()
    return tokenizer


def test_reasoning_dropped_and_arguments_resorted_still_extend(tok):
    first = render_request(tok, ChatRequest([SYSTEM, USER], tools=TOOLS))
    start = first.message_ends[-1]
    prefix = first.token_ids[start:]
    assert decode_rendered(tok, prefix) == "<|im_start|>assistant\n<think>\n"
    # the answer as sampled: 'Paris' spelled one character per token (re-tokenizes as one)
    answer = [i for ch in "Paris" for i in tok.encode_rendered(ch)] + tok.encode_rendered(
        " it is.\n</think>\n\n" + CALL)
    assert tok.encode_rendered(tok.decode(answer)) != answer
    store = ReplayStore()
    store.record(GeneratedTurn(prefix, decode_rendered(tok, prefix), answer, "", "Paris it is.",
                               (("call_1", "get_weather", canonical_arguments('{"unit": "C", "city": "Paris"}')),),
                               context_key(USER)))
    back = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"C"}'}}]}
    held = first.token_ids + answer
    for tail in ([{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                 [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                  {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Rome?"}]):
        request = ChatRequest([SYSTEM, USER, back, *tail], tools=TOOLS)
        spliced, count = render_with_replay(tok, request, store, render_request)
        assert count == 1
        assert spliced.token_ids[:len(held)] == held
        footer = tok.encode_rendered("<|im_end|>\n")
        assert spliced.token_ids[len(held):len(held) + len(footer)] == footer
        assert first.message_ends[:2] == spliced.message_ends[:2]
        if len(tail) == 1:  # (with a later user message this template re-renders the turn
            # differently from its prefix render, so no boundary is found for it there)
            assert len(held) + len(footer) in spliced.message_ends  # the turn's boundary, mapped
        # the template alone re-renders the turn without its reasoning: a miss inside the answer
        plain = render_request(tok, request).token_ids
        assert plain[:len(held)] != held
    # template mode (no store): the plain render
    assert render_with_replay(tok, request, None, render_request)[1] == 0
