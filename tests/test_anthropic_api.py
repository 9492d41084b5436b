"""POST /v1/messages and /v1/messages/count_tokens in process (echo engine), through the official
``anthropic`` SDK and raw HTTP. The echo engine answers with the last user message."""

import json
import re

import anthropic
import pydantic
import pytest

from sdk_app import EchoApp


@pytest.fixture
def echo():
    with EchoApp() as app:
        yield app


def sdk(app):
    return anthropic.Anthropic(base_url=app.url, api_key="dummy", http_client=app.client, max_retries=0)


def test_sdk_non_streamed_and_streamed_multi_turn_reuse(echo):
    client = sdk(echo)
    history, previous = [], None
    for turn, text in enumerate(["first question", "second one, longer", "third 🙂"]):
        history.append({"role": "user", "content": text})
        if turn % 2:
            with client.messages.stream(model="m", max_tokens=100, system="sys", messages=history) as stream:
                for _ in stream:
                    pass
                message = stream.get_final_message()
        else:
            message = client.messages.create(model="m", max_tokens=100, system="sys", messages=history)
        assert message.content[0].text == text and message.stop_reason == "end_turn"
        usage = message.usage
        total = usage.input_tokens + usage.cache_read_input_tokens
        if previous is not None:
            # the held state holds the whole previous prompt and answer
            assert usage.cache_read_input_tokens >= previous[0] + previous[1] - 1
            assert usage.cache_read_input_tokens > previous[2]
        previous = (total, usage.output_tokens, usage.cache_read_input_tokens)
        history.append({"role": "assistant", "content": [{"type": "text", "text": message.content[0].text}]})


def test_max_tokens_and_stop_sequence(echo):
    client = sdk(echo)
    cut = client.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "abcdef"}])
    assert cut.content[0].text == "abc" and cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stopped = client.messages.create(model="m", max_tokens=50, stop_sequences=["cd"],
                                     messages=[{"role": "user", "content": "abcdef"}])
    assert stopped.content[0].text == "ab"
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "cd")


def test_an_empty_answer_has_no_content_block(echo):
    # Anthropic answers [] (an empty text block sent back in the history is refused there)
    client = sdk(echo)
    fields = dict(model="m", max_tokens=50, stop_sequences=["a"], messages=[{"role": "user", "content": "abc"}])
    message = client.messages.create(**fields)
    assert message.content == [] and message.stop_reason == "stop_sequence"
    with client.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content == [] and "content_block_start" not in kinds and kinds[-1] == "message_stop"
    again = client.messages.create(model="m", max_tokens=50, messages=[
        {"role": "user", "content": "abc"}, {"role": "assistant", "content": message.content},
        {"role": "user", "content": "next"}])
    assert again.content[0].text == "next"


def test_raw_stream_event_order_and_ping_free_text(echo):
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hey"}]}
    with echo.client.stream("POST", "/v1/messages", json=body,
                            headers={"anthropic-version": "2023-06-01", "anthropic-beta": "made-up-beta-2099"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    datas = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert [d["type"] for d in datas] == names
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
    assert text == "hey"


def test_message_start_usage_already_splits_reused_and_prefilled_input(echo):
    """``message_start`` is sent once the engine has planned the request, so a client reading
    input usage there (as some proxies and loggers do) sees the cache hit the final usage has."""
    history = [{"role": "user", "content": "a first question"}]
    for turn in range(2):
        body = {"model": "m", "max_tokens": 50, "stream": True, "messages": history}
        with echo.client.stream("POST", "/v1/messages", json=body) as r:
            frames = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
        start = frames[0]["message"]["usage"]
        final = next(f for f in frames if f["type"] == "message_delta")["usage"]
        assert (start["input_tokens"], start["cache_read_input_tokens"]) == \
            (final["input_tokens"], final["cache_read_input_tokens"])
        assert (start["cache_read_input_tokens"] > 0) == (turn == 1)
        text = "".join(f["delta"]["text"] for f in frames if f["type"] == "content_block_delta")
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "and a second"}]


def test_count_tokens(echo):
    client = sdk(echo)
    messages = [{"role": "user", "content": "hello"}]
    counted = client.messages.count_tokens(model="m", system="sys", messages=messages)
    reply = client.messages.create(model="m", max_tokens=5, system="sys", messages=messages)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert echo.engine.prefilled_tokens == counted.input_tokens  # count_tokens ran nothing


@pytest.mark.parametrize("body,status,kind,needle", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 5, "temperature": 3, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error", "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "text-only"),
    # the message names no chat-completions value ('required') the client never sent
    ({"max_tokens": 5, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]},
     400, "invalid_request_error", "tool_choice forces a tool call, but the request has no tools"),
])
def test_errors_in_anthropic_shape(echo, body, status, kind, needle):
    r = echo.client.post("/v1/messages", json={"model": "m", **body})
    assert r.status_code == status
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and needle in error["error"]["message"]


def test_sdk_raises_typed_errors(echo):
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk(echo).messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_not_json_and_engine_failure(echo):
    r = echo.client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = echo.client.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    r = echo.client.post("/v1/messages/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = echo.client.post("/v1/messages", json={"model": "m", "max_tokens": 5,
                                                "messages": [{"role": "user", "content": "FAIL!"}]})
    assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    ok = echo.client.post("/v1/messages", json={"model": "m", "max_tokens": 5,
                                                 "messages": [{"role": "user", "content": "fine"}]})
    assert ok.status_code == 200 and ok.json()["content"][0]["text"] == "fine"


def test_ping_events_while_the_output_is_quiet():
    with EchoApp(ping_interval_s=0.05, delay_ms=150) as app:
        body = {"model": "m", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "abc"}]}
        with app.client.stream("POST", "/v1/messages", json=body) as r:
            frames = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [f["type"] for f in frames]
    assert kinds.count("ping") >= 2 and kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "".join(f["delta"]["text"] for f in frames if f["type"] == "content_block_delta") == "abc"


def claude_code_body(history, nonce):
    """A request shaped like Claude Code's: billing block with a fresh nonce, cache_control on
    the last message only, tools, thinking, metadata.user_id, stream."""
    messages = json.loads(json.dumps(history))
    for message in messages:
        for block in message["content"]:
            block.pop("cache_control", None)
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return {"model": "m", "max_tokens": 200, "stream": True,
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={nonce};"},
                       {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Long instructions. " * 20, "cache_control": {"type": "ephemeral"}}],
            "messages": messages,
            "tools": [{"name": "Bash", "description": "run", "input_schema": {
                "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}],
            "thinking": {"type": "enabled", "budget_tokens": 1000},
            "metadata": {"user_id": "session-1"}}


def test_claude_code_shaped_session_extends_the_held_state_every_turn(echo):
    client = sdk(echo)
    history, previous, uncached = [], None, 0
    for turn in range(4):
        history.append({"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
            {"type": "text", "text": f"task number {turn}"}]})
        body = claude_code_body(history, nonce=f"{turn:05x}")
        with client.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as stream:
            for _ in stream:
                pass
            message = stream.get_final_message()
        usage = message.usage
        total = usage.input_tokens + usage.cache_read_input_tokens
        if previous is not None:
            assert usage.cache_read_input_tokens >= previous[0] + previous[1] - 1, (turn, usage, previous)
        previous = (total, usage.output_tokens)
        uncached += usage.input_tokens
        history.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": "s"},
            *[block.model_dump(exclude_none=True) for block in message.content]]})
    # the engine prefilled exactly the uncached input the usage reported, nothing more
    assert echo.engine.prefilled_tokens == uncached


def call_text(name, arguments, thinking=None):
    """A scripted echo answer: the model 'thinks' (after the prompt's <think>) then calls."""
    call = "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
    return (f"{thinking}\n</think>\n\n" if thinking is not None else "") + call


TOOLS = [{"name": "ls", "description": "list a folder", "input_schema": {
             "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
         {"name": "cat", "description": "print a file", "input_schema": {
             "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.mark.parametrize("streamed", [False, True])
def test_sdk_tool_calling_loop_with_thinking(echo, streamed):
    """Three tool-calling turns: the echo engine repeats the last user or tool message, so each
    tool result scripts the next answer. Thinking is on: the prompt opens <think>."""
    client = sdk(echo)
    script = [call_text("ls", {"path": "."}, thinking="List first."),
              call_text("cat", {"path": "a.txt"}, thinking="Now read it."),
              "Read it.\n</think>\n\nThe file says hi."]
    messages = [{"role": "user", "content": script[0]}]
    previous = None
    for turn in range(3):
        fields = dict(model="m", max_tokens=300, messages=messages, tools=TOOLS,
                      thinking={"type": "enabled", "budget_tokens": 100})
        if streamed:
            with client.messages.stream(**fields) as stream:
                deltas = [e for e in stream if e.type == "content_block_delta"]
                message = stream.get_final_message()
            assert any(d.delta.type == "input_json_delta" for d in deltas) == (turn < 2)
        else:
            message = client.messages.create(**fields)
        kinds = [block.type for block in message.content]
        assert message.content[0].thinking == ["List first.", "Now read it.", "Read it."][turn]
        if turn < 2:
            assert kinds == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
            call = message.content[1]
            assert (call.name, call.input) == [("ls", {"path": "."}), ("cat", {"path": "a.txt"})][turn]
            assert call.id.startswith("toolu_") and len(call.id) == 30  # Anthropic's id style
        else:
            assert kinds == ["thinking", "text"] and message.content[1].text == "The file says hi."
            assert message.stop_reason == "end_turn"
        usage = message.usage
        if previous is not None:
            assert usage.cache_read_input_tokens >= previous[0] + previous[1] - 1, (turn, usage, previous)
        previous = (usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        if turn < 2:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": message.content[1].id, "content": script[turn + 1]}]})


def test_forced_tool_choice(echo):
    # the grammar forces a call of ls; the echo script writes the call it allows
    message = sdk(echo).messages.create(model="m", max_tokens=300, tools=TOOLS,
                                        tool_choice={"type": "tool", "name": "ls"},
                                        messages=[{"role": "user", "content": call_text("ls", {"path": "/"})}])
    assert [b.type for b in message.content] == ["tool_use"] and message.content[0].input == {"path": "/"}
    assert message.content[0].id.startswith("toolu_")


def test_a_final_assistant_message_is_a_prefill_the_answer_continues(echo):
    from redlite.core.byte_tokenizer import ByteTokenizer

    client = sdk(echo)
    user = {"role": "user", "content": "count to five"}
    prefill = {"role": "assistant", "content": "1, 2,"}
    expected = ByteTokenizer().render_chat([user]).token_ids + list(b"1, 2,")
    counted = client.messages.count_tokens(model="m", messages=[user, prefill])
    assert counted.input_tokens == len(expected)  # no end of turn after the prefill
    message = client.messages.create(model="m", max_tokens=40, messages=[user, prefill])
    assert message.content[0].text == "count to five"  # the echo's answer only, not the prefill
    assert echo.engine.held_ids[:len(expected)] == expected
    # the client joins prefill and answer: the next turn extends the held state
    history = [user, {"role": "assistant", "content": "1, 2," + message.content[0].text},
               {"role": "user", "content": "again"}]
    again = client.messages.create(model="m", max_tokens=40, messages=history)
    assert again.usage.cache_read_input_tokens >= len(expected)
    # an empty final assistant message is no prefill; trailing whitespace is refused
    empty = client.messages.count_tokens(model="m", messages=[user, {"role": "assistant", "content": ""}])
    assert empty.input_tokens == len(ByteTokenizer().render_chat([user]).token_ids)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model="m", max_tokens=5, messages=[user, {"role": "assistant", "content": "1, "}])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chars", [64, 2000])
def test_prompt_too_long_in_anthropic_wording(chars):
    """A prompt over the context is Anthropic's 400 ``prompt is too long: N tokens > M maximum``:
    the phrase Claude Code's compact-and-retry (and other agents) match, and the counts it parses.
    64 characters fit the context before rendering and not after (the exact count); 2000 are
    refused by the bound computed before rendering (N a lower bound, said after the counts)."""
    with EchoApp(max_context=64) as small:
        for stream in (False, True):
            r = small.client.post("/v1/messages", json={
                "model": "m", "max_tokens": 5, "stream": stream,
                "messages": [{"role": "user", "content": "x" * chars}]})
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert re.match(r"prompt is too long: \d+ tokens > 64 maximum",
                                error["message"]), error["message"]


class Answer(pydantic.BaseModel):
    n: int


@pytest.mark.timeout(60)
def test_structured_output_follows_the_schema(echo):
    """``output_config.format`` (and the beta's top-level ``output_format``) constrain the text
    to the JSON schema, as ``response_format`` does on chat: the SDK's ``messages.parse`` gets
    its object (the echo engine would say '{"n": 42} and more' unconstrained)."""
    client = sdk(echo)
    said = [{"role": "user", "content": '{"n": 42} and more'}]
    parsed = client.messages.parse(model="m", max_tokens=50, messages=said, output_format=Answer)
    assert parsed.parsed_output == Answer(n=42) and parsed.stop_reason == "end_turn"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with client.messages.stream(model="m", max_tokens=50, messages=said,
                                output_config={"format": {"type": "json_schema", "schema": schema}}) as stream:
        assert stream.get_final_text() == '{"n": 42}'
    beta = echo.client.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": said,
                                                  "output_format": {"type": "json_schema", "schema": schema}})
    assert beta.json()["content"][0]["text"] == '{"n": 42}'
    bad = echo.client.post("/v1/messages", json={"model": "m", "max_tokens": 50, "messages": said,
                                                 "output_config": {"format": {"type": "json_schema",
                                                                              "schema": {"type": "bogus"}}}})
    assert bad.status_code == 400 and "output_config.format" in bad.json()["error"]["message"]


def test_a_tool_use_without_its_result_is_answered(echo):
    """Unlike Anthropic's API (a 400), a history whose tool_use lacks a tool_result in the next
    message is served as it stands (README: a history an agent broke still gets an answer)."""
    calls = [{"type": "tool_use", "id": f"toolu_{i}", "name": "ls", "input": {"path": p}}
             for i, p in enumerate((".", "/"))]
    messages = [{"role": "user", "content": "list both"}, {"role": "assistant", "content": calls},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "a.txt"}]}]
    r = echo.client.post("/v1/messages", json={"model": "m", "max_tokens": 20, "tools": TOOLS,
                                                "messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "a.txt"  # the echo engine repeats the tool result
