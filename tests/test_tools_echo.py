"""Tool calling end to end on the echo engine, in process: the official openai client and the
OpenAI Agents SDK run multi-turn tool loops; calls arrive parsed, results go back, and
cached_tokens grows each turn by exactly the previous prompt plus the generated call.

The echo engine repeats the last user or tool message, so a user (or tool result) message
holding a call's text (:func:`inprocess.echo_call`) is answered with that call."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from inprocess import async_client, echo_call, inprocess_app
from redlite.server.chat_service import ChatOptions

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


@pytest.fixture
def app():
    with inprocess_app() as (app, _):
        yield app


async def ask(client, messages, stream, **fields):
    """(message dict, finish_reason, usage) of one chat completion, streamed or not."""
    if not stream:
        reply = await client.chat.completions.create(model="echo", messages=messages, **fields)
        choice = reply.choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason, reply.usage
    chunks = await client.chat.completions.create(model="echo", messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **fields)
    content, reasoning, calls, finish, usage = "", "", {}, None, None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.id is not None:  # a call's start: the name comes first
                    assert call.index not in calls and call.function.name
                    calls[call.index] = {"id": call.id, "type": "function", "function": {
                        "name": call.function.name, "arguments": call.function.arguments or ""}}
                else:
                    calls[call.index]["function"]["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_three_tool_turns_extend_the_held_state(app, stream):
    async def main():
        client = openai.AsyncOpenAI(base_url="http://redlite/v1", api_key="x", http_client=async_client(app))
        messages = [{"role": "system", "content": "You call tools."},
                    {"role": "user", "content": echo_call("get_weather", {"city": "Paris"})}]
        previous = None
        for turn, city in enumerate(["Paris", "Oslo", "Lima"]):
            message, finish, usage = await ask(client, messages, stream, tools=[WEATHER])
            assert finish == "tool_calls"
            assert message.get("content") is None
            [call] = message["tool_calls"]
            assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": city}
            if previous is not None:
                assert usage.prompt_tokens_details.cached_tokens >= previous  # prompt + call
            previous = usage.prompt_tokens + usage.completion_tokens
            nxt = ["Oslo", "Lima", None][turn]
            result = echo_call("get_weather", {"city": nxt}) if nxt else "Sunny, 21 C."
            messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": result}]
        message, finish, usage = await ask(client, messages, stream, tools=[WEATHER])
        assert (message["content"], finish) == ("Sunny, 21 C.", "stop")
        assert usage.prompt_tokens_details.cached_tokens >= previous
    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_in_both_names_and_tool_choice_none(app, stream):
    async def main():
        client = openai.AsyncOpenAI(base_url="http://redlite/v1", api_key="x", http_client=async_client(app))
        text = "Let me think.\n</think>\n\nThe answer."
        message, finish, _ = await ask(client, [{"role": "user", "content": text}], stream,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert (message["reasoning_content"], message["content"], finish) == \
            ("Let me think.", "The answer.", "stop")
        if not stream:
            assert message["reasoning"] == "Let me think."
        call = echo_call("get_weather", {"city": "Paris"})
        message, finish, _ = await ask(client, [{"role": "user", "content": call}], stream,
                                       tools=[WEATHER], tool_choice="none")
        assert (message["content"], finish, "tool_calls" in message) == (call, "stop", False)
    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_forces_the_call(app, stream):
    async def main():
        client = openai.AsyncOpenAI(base_url="http://redlite/v1", api_key="x", http_client=async_client(app))
        # the echo answer continues the forced opening: only the arguments are "generated"
        messages = [{"role": "user", "content": '{"city": "Rome"}}\n</tool_call>'}]
        message, finish, _ = await ask(client, messages, stream, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in message["tool_calls"]] == [("get_weather", {"city": "Rome"})]
    run(main())


def test_history_shapes_render(app):
    async def main():
        http = async_client(app)
        body = {"messages": [
            {"role": "system", "content": "one"}, {"role": "developer", "content": "two"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "reasoning": "r",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"X\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}],
            "tools": [WEATHER]}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "done"
        bad = await http.post("/v1/chat/completions", json={**body, "tool_choice": {
            "type": "function", "function": {"name": "nope"}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
        bad = await http.post("/v1/chat/completions", json={**body, "tools": [{"type": "web"}]})
        assert bad.status_code == 400
    run(main())


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_sdk_function_tool_loop(app, streamed):
    import agents
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        seen.append(city)
        return f"Sunny in {city}."

    async def main():
        client = openai.AsyncOpenAI(base_url="http://redlite/v1", api_key="x", http_client=async_client(app))
        model = agents.OpenAIChatCompletionsModel(model="echo", openai_client=client)
        agent = agents.Agent(name="weather", instructions="Use tools.", tools=[get_weather], model=model)
        prompt = echo_call("get_weather", {"city": "Paris"})
        if streamed:
            result = agents.Runner.run_streamed(agent, prompt)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, prompt)
        return result.final_output

    assert run(main()) == "Sunny in Paris."
    assert seen == ["Paris"]


def test_reasoning_dropped_by_the_client_rewinds_and_says_why(caplog):
    """With ``--replay template`` (exact replay splices the generated turn back instead: see
    tests/test_replay_echo.py)."""
    async def main(app):
        http = async_client(app)
        call = echo_call("get_weather", {"city": "Paris"})
        first = [{"role": "user", "content": "I need the weather.\n</think>\n\n" + call}]
        fields = {"tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": True}}
        r = (await http.post("/v1/chat/completions", json={"messages": first, **fields})).json()
        message = r["choices"][0]["message"]
        assert message["reasoning_content"] == "I need the weather."
        held = r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
        tool = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"}
        kept = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls", "reasoning_content")}
        dropped = {k: v for k, v in kept.items() if k != "reasoning_content"}
        caplog.clear()
        with caplog.at_level("INFO", logger="redlite.generation"):
            r = (await http.post("/v1/chat/completions", json={"messages": first + [dropped, tool], **fields})).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] < held
        line = next(m for m in caplog.messages if "cache miss" in m)
        assert "inside the previous answer" in line and "I need" in line
        # the same turn sent back with its reasoning re-renders identically: a plain extension
        r = (await http.post("/v1/chat/completions", json={"messages": first, **fields})).json()
        held = r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
        r = (await http.post("/v1/chat/completions", json={"messages": first + [kept, tool], **fields})).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    with inprocess_app(chat_options=ChatOptions(replay="template")) as (app, _):
        run(main(app))
