"""An answer with text after a tool call (``before <call> after``), in process (echo engine),
through the official ``openai`` and ``anthropic`` SDKs: the items of a Responses answer and the
blocks of a Messages answer come in generation order, streamed or not, and sent back as the
client got them the next turn reuses the whole answer."""

import json

import anthropic
import openai
import pytest

from sdk_app import EchoApp

CALL = "<tool_call>\n" + json.dumps({"name": "shell", "arguments": {"cmd": ["ls"]}}) + "\n</tool_call>"
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}
TOOLS = [{"type": "function", "name": "shell", "parameters": SCHEMA}]


@pytest.fixture
def echo():
    with EchoApp() as app:
        yield app


def openai_sdk(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="dummy", http_client=app.client, max_retries=0)


def respond(client, stream, **fields):
    if not stream:
        return client.responses.create(model="m", tools=TOOLS, **fields)
    with client.responses.stream(model="m", tools=TOOLS, **fields) as events:
        for _ in events:
            pass
        return events.get_final_response()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [True, False])
def test_responses_replay_of_text_after_a_call_reuses_the_answer(echo, stream):
    """Codex replays the output items with ``store: false``: a message item after a
    function_call of the same answer was read as a second assistant turn, so the next turn
    missed the held state inside the previous answer."""
    client = openai_sdk(echo)
    items = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "before " + CALL + " after"}]
    first = respond(client, stream, input=items, store=False)
    call = next(item for item in first.output if item.type == "function_call")
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "listed"})
    second = respond(client, stream, input=items, store=False)
    assert second.output_text == "listed"
    held = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= held, (first.usage, second.usage)
