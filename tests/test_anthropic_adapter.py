"""Anthropic Messages adapter, pure parts: body -> ChatRequest and the event builders."""

import json
import logging

import pytest
from pydantic import ValidationError

from redlite.core.chat import ChatOutput, OutputEvent, ToolCall, ToolCallDelta
from redlite.server.anthropic_convert import to_chat_request
from redlite.server.anthropic_events import MessageStream, message_body, thinking_signature
from redlite.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from redlite.server.errors import error_body
from redlite.server.wire_common import Usage



def convert(**fields):
    return to_chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 64, **fields}))


def test_full_conversation_converts_to_openai_history():
    chat = convert(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                {"type": "text", "text": "You are a helper.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "list files"},
                                         {"type": "text", "text": "now", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call ls.", "signature": "sig"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}},
                {"type": "tool_use", "id": "toolu_2", "name": "cat", "input": {"path": "ä"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no such file"}]},
                {"type": "text", "text": "go on"}]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"},
                                              {"type": "text", "text": "done"}]},
        ],
        tools=[{"name": "ls", "description": "list", "input_schema": {"type": "object"}},
               {"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 1024},
        stop_sequences=["END"], temperature=0.5, top_k=7)
    assert chat.messages == [
        {"role": "system", "content": "You are a helper.\n\nBe brief."},
        {"role": "user", "content": "list files\n\nnow"},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "I should call ls.",
         "tool_calls": [
             {"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "cat", "arguments": '{"path": "ä"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such file"},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": "done"},
    ]
    assert chat.tools == [{"type": "function", "function": {
        "name": "ls", "parameters": {"type": "object"}, "description": "list"}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.template_kwargs == {"enable_thinking": True}
    assert chat.stop == ["END"] and chat.max_tokens == 64
    assert chat.sampling.temperature == 0.5 and chat.sampling.top_k == 7
    assert chat.request_id.startswith("msg_")


def test_assistant_with_only_tool_use_has_null_content():
    chat = convert(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])
    assert chat.messages[-1]["content"] is None
    assert chat.messages[-1]["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "tool", "name": "ls"}, "ls")])
def test_tool_choice(choice, expected):
    assert convert(messages=[{"role": "user", "content": "x"}], tool_choice=choice).tool_choice == expected


@pytest.mark.parametrize("thinking,kwargs", [
    (None, {}), ({"type": "adaptive"}, {}), ({"type": "disabled"}, {"enable_thinking": False})])
def test_thinking_switch(thinking, kwargs):
    fields = {"thinking": thinking} if thinking else {}
    assert convert(messages=[{"role": "user", "content": "x"}], **fields).template_kwargs == kwargs


def test_billing_block_dropped_and_logged_once(caplog):
    import redlite.server.anthropic_convert as module
    module._logged_once.discard("billing")
    with caplog.at_level(logging.INFO, logger="redlite.server.anthropic"):
        for nonce in ("a1", "b2"):
            chat = convert(system=[{"type": "text", "text": f"x-anthropic-billing-header: cch={nonce};"},
                                   {"type": "text", "text": "S"}],
                           messages=[{"role": "user", "content": "x"}])
            assert chat.messages[0] == {"role": "system", "content": "S"}
    assert sum("billing" in r.getMessage() for r in caplog.records) == 1


def test_cache_control_does_not_change_the_history():
    plain = convert(system="S", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    marked = convert(system=[{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
                     messages=[{"role": "user", "content": [
                         {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
    assert plain.messages == marked.messages


@pytest.mark.parametrize("role,block", [
    ("user", {"type": "tool_use", "id": "t", "name": "f", "input": {}}),
    ("assistant", {"type": "tool_result", "tool_use_id": "t", "content": "x"}),
    ("user", {"type": "server_tool_use", "id": "x"}),
    ("assistant", {"type": "tool_use", "name": "f", "input": {}}),
    ("user", {"type": "text", "text": 5}),
])
def test_blocks_a_role_cannot_hold_are_refused(role, block):
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": role, "content": [block]}]})


@pytest.mark.parametrize("block", [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
    {"type": "document", "source": {}},
    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]},
])
def test_media_blocks_are_refused_as_unsupported_content(block):
    with pytest.raises(ValidationError) as info:
        MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": "user", "content": [block]}]})
    unsupported = [e for e in info.value.errors() if e["type"] == "unsupported_content"]
    assert unsupported and "text-only" in unsupported[0]["msg"]


def test_count_tokens_body_needs_no_max_tokens():
    chat = to_chat_request(CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}))
    assert chat.messages == [{"role": "user", "content": "x"}] and chat.max_tokens is None


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (404, "not_found_error"),
                                         (413, "request_too_large"), (500, "api_error"),
                                         (503, "overloaded_error")])
def test_error_shape(status, kind):
    assert error_body(status, "m", surface="anthropic") == {"type": "error", "error": {"type": kind, "message": "m"}}


# --- events ------------------------------------------------------------------------------------

def replay(events):
    """Rebuild the message from a stream's events, checking Anthropic's order rules."""
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    assert events[-2]["type"] == "message_delta"
    message = dict(events[0]["message"])
    blocks, open_index, partial = [], None, {}
    for event in events[1:-2]:
        kind = event["type"]
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert open_index is None and event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
            open_index = event["index"]
        elif kind == "content_block_delta":
            assert event["index"] == open_index
            block, delta = blocks[open_index], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                assert delta["type"] == "input_json_delta"
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
        else:
            assert kind == "content_block_stop" and event["index"] == open_index
            if open_index in partial:
                blocks[open_index]["input"] = json.loads(partial[open_index])
            open_index = None
    assert open_index is None
    message["content"] = blocks
    message["stop_reason"] = events[-2]["delta"]["stop_reason"]
    message["stop_sequence"] = events[-2]["delta"]["stop_sequence"]
    message["usage"] = events[-2]["usage"]
    return message


def stream_of(pieces, output, usage):
    stream = MessageStream("msg_1", "m", usage.prompt_tokens)
    events = stream.start()
    for i, piece in enumerate(pieces):
        events += stream.feed(piece)
        if i == 1:
            events.append(stream.ping())
    return events + stream.finish(output, usage)


CALL_ARGS = '{"path": "src", "depth": 2}'
SEQUENCES = {
    "thinking, text, two calls": (
        [OutputEvent("reasoning", "Let me "), OutputEvent("reasoning", "look."),
         OutputEvent("content", "Sure: "), OutputEvent("content", "calling."),
         OutputEvent("tool_call", ToolCallDelta(0, "", "call_a", "ls")),
         OutputEvent("tool_call", ToolCallDelta(0, '{"path": ')), OutputEvent("tool_call", ToolCallDelta(0, '"src", "depth": 2}')),
         OutputEvent("tool_call", ToolCallDelta(1, "", "call_b", "pwd")), OutputEvent("tool_call", ToolCallDelta(1, "{}"))],
        ChatOutput(content="Sure: calling.", reasoning="Let me look.", finish_reason="tool_calls",
                   tool_calls=[ToolCall("call_a", "ls", CALL_ARGS), ToolCall("call_b", "pwd", "{}")]),
        "tool_use"),
    "text only": ([OutputEvent("content", "héllo "), OutputEvent("content", "🙂")],
                  ChatOutput(content="héllo 🙂"), "end_turn"),
    "cut by max_tokens": ([OutputEvent("content", "abc")], ChatOutput(content="abc", finish_reason="length"),
                          "max_tokens"),
    "stop sequence": ([OutputEvent("content", "x")], ChatOutput(content="x", stop_sequence="END"),
                      "stop_sequence"),
    "empty": ([], ChatOutput(content=""), "end_turn"),
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_stream_pieces_rebuild_the_non_streamed_message(name):
    pieces, output, stop_reason = SEQUENCES[name]
    usage = Usage(prompt_tokens=100, completion_tokens=9, cached_tokens=60)
    events = stream_of(pieces, output, usage)
    body = message_body("msg_1", "m", output, usage)
    assert replay(events) == body
    assert body["stop_reason"] == stop_reason
    assert body["usage"] == {"input_tokens": 40, "output_tokens": 9, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 60}
    assert events[0]["message"]["usage"]["input_tokens"] == 100


def test_block_shapes_and_order():
    pieces, output, _ = SEQUENCES["thinking, text, two calls"]
    events = stream_of(pieces, output, Usage(10, 5, 0))
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["message_start", "content_block_start", "content_block_delta",
                         "content_block_delta", "ping"]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""},
                      {"type": "tool_use", "id": "call_a", "name": "ls", "input": {}},
                      {"type": "tool_use", "id": "call_b", "name": "pwd", "input": {}}]
    signature = [e for e in events if e.get("delta", {}).get("type") == "signature_delta"]
    assert len(signature) == 1 and signature[0]["index"] == 0
    assert signature[0]["delta"]["signature"] == thinking_signature("Let me look.")
    json_pieces = [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"]
    assert json_pieces == ['{"path": ', '"src", "depth": 2}', "{}"]


def test_mid_conversation_system_message_becomes_a_user_reminder():
    chat = convert(system="S", messages=[{"role": "user", "content": "hi"},
                                         {"role": "system", "content": "Agents: a, b"}])
    assert chat.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                             {"role": "user", "content": "<system-reminder>\nAgents: a, b\n</system-reminder>"}]
