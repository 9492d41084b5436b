"""POST /v1/responses (and GET/DELETE of stored responses) in process (echo engine), through the
official ``openai`` SDK's ``responses`` API and raw HTTP. The echo engine answers with the last
user message."""

import json

import openai
import pytest

from sdk_app import EchoApp


@pytest.fixture
def echo():
    with EchoApp() as app:
        yield app


def sdk(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="dummy", http_client=app.client, max_retries=0)


def test_previous_response_id_chain_reuses_everything(echo):
    client = sdk(echo)
    previous, last = None, None
    for turn, text in enumerate(["one", "two, longer", "three 🙂"]):
        fields = {"previous_response_id": previous} if previous else {}
        if turn == 1:
            with client.responses.stream(model="m", input=text, instructions="sys", **fields) as stream:
                for _ in stream:
                    pass
                response = stream.get_final_response()
        else:
            response = client.responses.create(model="m", input=text, instructions="sys", **fields)
        assert response.output_text == text and response.status == "completed"
        usage = response.usage
        if last is not None:
            # zero re-prefill of the history: everything up to the new input is reused
            assert usage.input_tokens_details.cached_tokens >= last.input_tokens + last.output_tokens - 1
        previous, last = response.id, usage
    stored = client.responses.retrieve(previous)
    assert stored.id == previous and stored.output_text == "three 🙂"


def test_store_false_with_replayed_input_items(echo):
    client = sdk(echo)
    items, last = [], None
    for text in ["alpha", "beta", "gamma"]:
        items.append({"role": "user", "content": [{"type": "input_text", "text": text}]})
        response = client.responses.create(model="m", input=items, store=False,
                                           include=["reasoning.encrypted_content"])
        assert response.output_text == text
        if last is not None:
            assert response.usage.input_tokens_details.cached_tokens >= last.input_tokens + last.output_tokens - 1
        last = response.usage
        items += [item.model_dump(exclude_none=True) for item in response.output]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_unknown_previous_response_is_a_404(echo):
    with pytest.raises(openai.NotFoundError) as info:
        sdk(echo).responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert info.value.body["code"] == "previous_response_not_found"
    r = echo.client.get("/v1/responses/resp_nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    ok = sdk(echo).responses.create(model="m", input="still serving")
    assert ok.output_text == "still serving"


def test_raw_stream_sequence_numbers_and_text(echo):
    body = {"model": "m", "input": "héllo", "stream": True, "max_output_tokens": 3}
    with echo.client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        frames = [f for f in r.read().decode().split("\n\n") if f]
    events = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert [f.split("\n")[0].removeprefix("event: ") for f in frames] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "hé" and events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_failure_is_response_failed(echo):
    body = {"model": "m", "input": "FAIL!", "stream": True}
    with echo.client.stream("POST", "/v1/responses", json=body) as r:
        frames = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1]["type"] == "response.failed"
    assert frames[-1]["response"]["status"] == "failed"
    assert frames[-1]["response"]["error"]["code"] == "engine_error"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "temperature": 9}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]}, "input.0.content.0"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    # an error of the shared chat service names the Responses field, not the chat one
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": {"type": "nonsense"}}}}, "text.format"),
])
def test_errors_in_openai_shape(echo, body, param):
    r = echo.client.post("/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("body,param,code", [
    ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported_field"),
    ({"input": "x", "conversation": {"id": "conv_1"}}, "conversation", "unsupported_field"),
    ({"input": "x", "prompt": {"id": "pmpt_1", "version": "2"}}, "prompt", "unsupported_field"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_1"}]}, "input.1", None),
])
def test_fields_that_would_change_the_conversation_are_refused_not_ignored(echo, body, param, code):
    """Ignoring these would answer another conversation than the client meant."""
    r = echo.client.post("/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code
    assert "not supported" in error["message"]
    assert echo.client.post("/v1/responses", json={"model": "m", "input": "x", "conversation": None}).status_code == 200


def test_prompt_too_long_names_input():
    with EchoApp(max_context=64) as small:
        r = small.client.post("/v1/responses", json={"model": "m", "input": "x" * 100})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"


def test_delete_stored_response(echo):
    client = sdk(echo)
    response = client.responses.create(model="m", input="keep me")
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def call_text(name, arguments, thinking=None):
    call = "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
    return (f"{thinking}\n</think>\n\n" if thinking is not None else "") + call


TOOLS = [{"type": "function", "name": "shell", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}},
         {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]


@pytest.mark.parametrize("mode", ["store_false_replay", "previous_response_id"])
def test_sdk_tool_calling_loop_codex_style(echo, mode):
    """Three turns (call, call, text): the echo engine repeats the last user or tool message, so
    each function_call_output scripts the next answer. Codex replays every item with
    ``store: false``; other clients chain ``previous_response_id``. Non-function tools are skipped."""
    client = sdk(echo)
    script = [call_text("shell", {"cmd": ["ls"]}), call_text("shell", {"cmd": ["cat", "a.txt"]}), "It says hi."]
    items = [{"role": "user", "content": [{"type": "input_text", "text": script[0]}]}]
    previous_id, last = None, None
    for turn in range(3):
        fields = dict(model="m", tools=TOOLS, instructions="You are Codex.",
                      include=["reasoning.encrypted_content"])
        if mode == "store_false_replay":
            fields.update(input=items, store=False)
        else:
            fields.update(input=items[-1:], previous_response_id=previous_id) if previous_id else fields.update(input=items)
        with client.responses.stream(**fields) as stream:
            kinds = [e.type for e in stream]
            response = stream.get_final_response()
        if turn < 2:
            calls = [item for item in response.output if item.type == "function_call"]
            assert len(calls) == 1 and calls[0].name == "shell"
            assert json.loads(calls[0].arguments) == [{"cmd": ["ls"]}, {"cmd": ["cat", "a.txt"]}][turn]
            assert "response.function_call_arguments.delta" in kinds
            items += [item.model_dump(exclude_none=True) for item in response.output]
            items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": script[turn + 1]})
        else:
            assert response.output_text == "It says hi."
        usage = response.usage
        if last is not None:
            assert usage.input_tokens_details.cached_tokens >= last.input_tokens + last.output_tokens - 1, (turn, usage)
        last, previous_id = usage, response.id


def test_reasoning_round_trips_through_encrypted_content(echo):
    """A scripted answer with <think>...</think> comes back as a reasoning item (text and our
    encrypted_content); replaying it with store: false renders the same history again."""
    client = sdk(echo)
    text = "<think>\nweighing options\n</think>\n\nanswer"
    response = client.responses.create(model="m", input=text, store=False, include=["reasoning.encrypted_content"])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.output_text == "answer"
    reasoning = response.output[0]
    assert reasoning.content[0].text == "weighing options" and reasoning.encrypted_content.startswith("rlr1.")
    replay = [{"role": "user", "content": text},
              {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content},
              response.output[1].model_dump(exclude_none=True),
              {"role": "user", "content": "next"}]
    second = client.responses.create(model="m", input=replay, store=False)
    assert second.output_text == "next"
    assert second.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens + response.usage.output_tokens - 1


@pytest.mark.timeout(30)
def test_objects_and_events_validate_against_the_sdk_types(echo):
    """Every streamed event and the final response, streamed or not, text or call, completed or
    incomplete, parse as the SDK's own (strict) types: a field the SDK requires (such as
    ``usage.input_tokens_details.cache_write_tokens``) is never missing."""
    from pydantic import TypeAdapter
    from openai.types.responses import Response, ResponseStreamEvent

    events, response = TypeAdapter(ResponseStreamEvent), TypeAdapter(Response)
    call = call_text("shell", {"cmd": ["ls"]})
    for fields in ({"input": "hello"}, {"input": "hello", "max_output_tokens": 2},
                   {"input": call, "tools": TOOLS[:1]}):
        body = {"model": "m", **fields}
        response.validate_python(echo.client.post("/v1/responses", json=body).json())
        with echo.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            frames = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                      if line.startswith("data: ")]
        for frame in frames:
            events.validate_python(frame)
        assert frames[-1]["response"]["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


@pytest.mark.timeout(60)
def test_input_tokens_count_is_the_prompt_the_response_reads(echo):
    """``POST /v1/responses/input_tokens`` (the SDK's ``responses.input_tokens.count``) counts the
    prompt a response to the same body would read, previous response included, generating
    nothing (it was a 405 "Method Not Allowed", the path taken for a response id)."""
    client = sdk(echo)
    first = client.responses.create(model="m", input="hello there", instructions="sys")
    fields = dict(model="m", input="and again", previous_response_id=first.id)
    prefilled = echo.engine.prefilled_tokens
    counted = client.responses.input_tokens.count(**fields)
    assert counted.object == "response.input_tokens" and echo.engine.prefilled_tokens == prefilled
    reply = client.responses.create(**fields)
    assert counted.input_tokens == reply.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="m", input="x", previous_response_id="resp_gone")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_is_echoed_in_the_response(echo, stream):
    """``tool_choice: {"type": "function", "name"}`` (Codex forcing a tool) is answered and echoed
    as the SDK's ``ToolChoiceFunction``: it was a 500 (a pydantic model in the JSON), and a
    stream cut before its first event."""
    from openai.types.responses import Response

    body = {"model": "m", "input": call_text("shell", {"cmd": ["ls"]}), "tools": TOOLS[:1],
            "tool_choice": {"type": "function", "name": "shell"}, "stream": stream}
    if stream:
        with echo.client.stream("POST", "/v1/responses", json=body) as r:
            frames = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                      if line.startswith("data: ")]
        final = frames[-1]["response"]
    else:
        final = echo.client.post("/v1/responses", json=body).json()
    response = Response.model_validate(final)
    assert response.tool_choice.name == "shell" and response.status == "completed"
    assert [item.name for item in response.output if item.type == "function_call"] == ["shell"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("schema,needle", [(None, "required"), (5, "must be an object"), ([], "must be an object")])
def test_json_schema_format_without_an_object_schema_says_which(echo, schema, needle):
    """A schema of the wrong type was answered "required" (as if missing), on both routes."""
    fmt = {"type": "json_schema", "name": "s"} | ({} if schema is None else {"schema": schema})
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        r = echo.client.post(path, json={"model": "m", "input": "x", "text": {"format": fmt}})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "text.format.schema" and needle in error["message"], error


@pytest.mark.timeout(30)
def test_allowed_tools_restricts_calls_and_keeps_every_tool_in_the_prompt(echo):
    """``tool_choice: {"type": "allowed_tools", "mode", "tools"}`` was a 400. The prompt (and so
    the held state) is the one with every tool; a scripted call of an allowed tool is made, one
    of a tool left out never is (plain ``required`` makes it); the choice is echoed as the SDK's
    ``ToolChoiceAllowed``."""
    from openai.types.responses import Response

    tools = [{"type": "function", "name": "ping"}, {"type": "function", "name": "read", "parameters": {"type": "object"}}]
    def choice(name, mode="required"):
        return {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": name}]}
    def called(script, tool_choice):
        body = {"model": "m", "input": call_text(script, {}), "tools": tools, "max_output_tokens": 100,
                "tool_choice": tool_choice}
        response = Response.model_validate(echo.client.post("/v1/responses", json=body).json())
        return response, [item.name for item in response.output if item.type == "function_call"]
    body = {"model": "m", "input": "x", "tools": tools}
    counted = [echo.client.post("/v1/responses/input_tokens", json={**body, "tool_choice": c}).json()
               for c in ("auto", choice("ping"))]
    assert counted[0] == counted[1]
    response, names = called("read", choice("read"))
    assert names == ["read"] and response.tool_choice.mode == "required"
    assert called("read", "required")[1] == ["read"]
    assert "read" not in called("read", choice("ping"))[1]
    assert "read" not in called("read", choice("ping", "auto"))[1]
    r = echo.client.post("/v1/responses", json={**body, "tool_choice": choice("nope")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
