"""OpenAI Responses adapter, pure parts: conversion, event builder, store, reasoning token."""

import json
import logging

import pytest
from pydantic import ValidationError

from redlite.core.chat import ChatOutput, OutputEvent, ToolCall, ToolCallDelta
from redlite.server.errors import APIError
from redlite.server.reasoning_token import decode_reasoning, encode_reasoning
from redlite.server.responses import assistant_message
from redlite.server.responses_convert import to_chat_request
from redlite.server.responses_events import ResponseStream, output_items, response_object
from redlite.server.responses_schemas import ResponsesRequest
from redlite.server.responses_store import ResponseStore
from redlite.server.wire_common import Usage


def convert(history=None, **fields):
    return to_chat_request(ResponsesRequest.model_validate({"model": "m", **fields}), history)


def test_string_input_and_instructions():
    chat = convert(input="hi", instructions="Be terse.", max_output_tokens=9, prompt_cache_key="k")
    assert chat.messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert chat.max_tokens == 9 and chat.session_key == "k" and chat.request_id.startswith("resp_")


def test_codex_shaped_items_convert_in_order(caplog):
    token = encode_reasoning("full reasoning")
    with caplog.at_level(logging.INFO, logger="redlite.server.responses"):
        chat = convert(instructions="sys", input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "perms"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "fix "}, {"type": "input_text", "text": "it"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
             "encrypted_content": token},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": ["ls"]}'},
            {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": '{"cmd": ["pwd"]}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "/w"}]},
            {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "ok"}]},
            {"type": "function_call", "call_id": "call_3", "name": "shell", "arguments": "{}"},
            {"type": "local_shell_call", "call_id": "x"},
            {"type": "function_call_output", "call_id": "call_3", "output": "done"},
            {"type": "reasoning", "id": "rs_3", "summary": [{"type": "summary_text", "text": "sum"}],
             "encrypted_content": "gAAAA-someone-elses"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fixed."}]},
        ], tools=[{"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False},
                  {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}, {"type": "local_shell"}],
            tool_choice="required", parallel_tool_calls=False, reasoning={"effort": "none"})
    assert chat.messages == [
        {"role": "system", "content": "sys"},
        {"role": "system", "content": "perms"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "full reasoning", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": ["ls"]}'}},
            {"id": "call_2", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": ["pwd"]}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": "/w"},
        {"role": "assistant", "content": None, "reasoning_content": "ok", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "done"},
        {"role": "assistant", "content": "Fixed.", "reasoning_content": "sum"},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.template_kwargs == {"enable_thinking": False}
    lines = [r.getMessage() for r in caplog.records]
    assert sum("tool(s) of types other than function" in line for line in lines) == 1
    assert sum("local_shell_call" in line for line in lines) == 1


def test_history_of_a_previous_response_goes_after_instructions():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat = convert(history, instructions="I", input=[{"role": "user", "content": "c"}])
    assert [m["content"] for m in chat.messages] == ["I", "a", "b", "c"]


@pytest.mark.parametrize("fields,param", [
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
])
def test_bad_choices_are_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as info:
        convert(**fields)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("item", [
    {"role": "robot", "content": "x"},
    {"type": "function_call", "name": "f", "arguments": "{}"},
    {"type": "message", "role": "user"},
    {"type": "function_call_output", "call_id": "c", "output": 5},
])
def test_malformed_items_are_refused(item):
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": [item]})


@pytest.mark.parametrize("choice", ["sometimes", {}, {"type": "allowed_tools"}, {"type": "function"}])
def test_unknown_tool_choices_are_refused(choice):
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": "x", "tool_choice": choice})


def test_media_parts_are_refused_as_unsupported_content():
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:x"}]}]})
    assert any(e["type"] == "unsupported_content" for e in info.value.errors())


def test_text_format_and_named_tool_choice():
    chat = convert(input="x", tool_choice={"type": "function", "name": "f"},
                   text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}})
    assert chat.tool_choice == "f"
    assert chat.response_format == {"type": "json_schema", "schema": {"type": "object"}, "strict": True}


def test_reasoning_token_round_trips_and_rejects_others():
    for text in ("", "plain", "ünïcode 🙂\n<think>"):
        assert decode_reasoning(encode_reasoning(text)) == text
    assert decode_reasoning("gAAAAABnot-ours") is None
    assert decode_reasoning("rlr1.%%%") is None
    assert decode_reasoning(encode_reasoning("x")[:-3]) is None


def test_store_bounds_evict_oldest():
    store = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        assert store.put(f"r{i}", [{"role": "user", "content": "x" * 100}], {"id": f"r{i}"})
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    small = ResponseStore(max_count=100, max_bytes=1000)
    for i in range(10):
        small.put(f"r{i}", [{"role": "user", "content": "y" * 300}], {"id": f"r{i}"})
    assert 0 < small.nbytes <= 1000 and small.get("r9") is not None and small.get("r0") is None
    assert not small.put("big", [{"role": "user", "content": "z" * 2000}], {})
    assert small.delete("r9") and not small.delete("r9")


# --- events ------------------------------------------------------------------------------------

META = {"id": "resp_1", "created_at": 1, "model": "m", "tools": []}


def replay(events):
    """Rebuild the output items from a stream's events, checking order and sequence numbers."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    items, open_item, text = [], None, ""
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert open_item is None and event["output_index"] == len(items)
            open_item, text = dict(event["item"]), ""
        elif kind.endswith(".delta"):
            assert event["output_index"] == len(items)
            text += event["delta"]
        elif kind == "response.output_item.done":
            item = event["item"]
            assert item["id"] == open_item["id"] and item["type"] == open_item["type"]
            if item["type"] == "function_call":
                assert item["arguments"] == text
            else:
                assert item["content"][0]["text"] == text
            items.append(item)
            open_item = None
        elif kind.endswith(".done") and "text" in event:
            assert event["text"] == text
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == text
    assert open_item is None
    return items, events[-1]


def test_stream_rebuilds_the_final_response():
    pieces = [OutputEvent("reasoning", "Think"), OutputEvent("reasoning", "ing."),
              OutputEvent("content", "Run "), OutputEvent("content", "ls."),
              OutputEvent("tool_call", ToolCallDelta(0, "", "call_a", "shell")),
              OutputEvent("tool_call", ToolCallDelta(0, '{"cmd":')), OutputEvent("tool_call", ToolCallDelta(0, '["ls"]}'))]
    output = ChatOutput(content="Run ls.", reasoning="Thinking.", finish_reason="tool_calls",
                        tool_calls=[ToolCall("call_a", "shell", '{"cmd":["ls"]}')])
    stream = ResponseStream(dict(META), encrypted=True)
    events = stream.start()
    for piece in pieces:
        events += stream.feed(piece)
    finished, response = stream.finish(output, Usage(50, 12, 30, 4))
    events += finished
    items, last = replay(events)
    assert last["type"] == "response.completed" and last["response"] == response
    assert response["output"] == items and response["status"] == "completed"
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert decode_reasoning(items[0]["encrypted_content"]) == "Thinking."
    assert items[2]["call_id"] == "call_a" and items[2]["name"] == "shell"
    assert response["usage"] == {"input_tokens": 50,
                                 "input_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 0},
                                 "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 4},
                                 "total_tokens": 62}
    non_streamed = output_items(output, encrypted=True)
    strip = [{k: v for k, v in i.items() if k != "id"} for i in non_streamed]
    assert strip == [{k: v for k, v in i.items() if k != "id"} for i in items]
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta"]


def test_incomplete_empty_and_failed():
    stream = ResponseStream(dict(META), encrypted=False)
    events = stream.start()
    events += stream.feed(OutputEvent("content", "ab"))
    finished, response = stream.finish(ChatOutput(content="ab", finish_reason="length"), Usage(5, 2, 0))
    items, last = replay(events + finished)
    assert last["type"] == "response.incomplete" and response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    empty = ResponseStream(dict(META), encrypted=False)
    events = empty.start()
    finished, response = empty.finish(ChatOutput(), Usage(5, 0, 0))
    items, _ = replay(events + finished)
    assert [i["content"][0]["text"] for i in items] == [""]
    failing = ResponseStream(dict(META), encrypted=False)
    events = failing.start() + failing.fail("engine_error", "boom")
    assert events[-1]["type"] == "response.failed" and events[-1]["sequence_number"] == 2
    assert events[-1]["response"]["error"] == {"code": "engine_error", "message": "boom"}


def test_response_object_echoes_request_fields():
    body = response_object(dict(META, instructions="I"), "completed", [], Usage(1, 1, 0))
    assert body["object"] == "response" and body["instructions"] == "I" and body["tools"] == []


def test_assistant_message_for_the_store():
    out = ChatOutput(content="", reasoning="r", tool_calls=[ToolCall("c", "f", "{}")], finish_reason="tool_calls")
    assert assistant_message(out) == {"role": "assistant", "content": None, "reasoning_content": "r",
                                      "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}
    assert json.dumps(assistant_message(ChatOutput(content="x"))) == '{"role": "assistant", "content": "x"}'
