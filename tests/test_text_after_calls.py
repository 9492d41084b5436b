"""An answer with text after a tool call (``before <call> after``), in process (echo engine),
through the official ``openai`` and ``anthropic`` SDKs: the items of a Responses answer and the
blocks of a Messages answer come in generation order, streamed or not, and sent back as the
client got them the next turn reuses the whole answer."""

import json

import anthropic
import pytest

from test_responses_api import echo  # noqa: F401 - the in-process echo app fixture
from test_responses_api import sdk as openai_sdk

CALL = "<tool_call>\n" + json.dumps({"name": "shell", "arguments": {"cmd": ["ls"]}}) + "\n</tool_call>"
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}
TOOLS = [{"type": "function", "name": "shell", "parameters": SCHEMA}]


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


CALL2 = "<tool_call>\n" + json.dumps({"name": "shell", "arguments": {"cmd": ["pwd"]}}) + "\n</tool_call>"
ANSWERS = ["before " + CALL + " after", CALL + "\nafter", "a " + CALL + " b " + CALL2 + " c",
           "<think>\nhmm\n</think>\n\nbefore " + CALL + " after", "only text", CALL]


def anthropic_sdk(app):
    return anthropic.Anthropic(base_url=app.url, api_key="dummy", http_client=app.client, max_retries=0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answer", ANSWERS, ids=["text-call-text", "call-text", "text-call-text-call-text",
                                               "think-text-call-text", "text", "call"])
def test_non_streamed_parts_come_in_the_streamed_order(echo, answer):
    """Non-streamed, the text after a call was joined to the text before it, ahead of the calls
    ([message "beforeafter", function_call]), while the stream sent it after the call."""
    client = openai_sdk(echo)
    seen = []
    for stream in (True, False):
        response = respond(client, stream, input=answer, max_output_tokens=400)
        seen.append([(item.type, item.content[0].text if item.type != "function_call" else item.arguments)
                     for item in response.output])
    assert seen[0] == seen[1]
    assert [kind for kind, _ in seen[0]] == ["function_call" if p.startswith("<tool_call>") else
                                             "reasoning" if p.startswith("<think>") else "message"
                                             for p in _pieces(answer)]
    client = anthropic_sdk(echo)
    tools = [{"name": "shell", "input_schema": SCHEMA}]
    fields = dict(model="m", max_tokens=400, messages=[{"role": "user", "content": answer}], tools=tools)
    with client.messages.stream(**fields) as events:
        streamed = events.get_final_message()
    whole = client.messages.create(**fields)
    assert [block.model_dump(exclude={"id"}) for block in whole.content] == \
        [block.model_dump(exclude={"id"}) for block in streamed.content]
    assert [block.type for block in whole.content] == [
        {"function_call": "tool_use", "reasoning": "thinking", "message": "text"}[kind] for kind, _ in seen[0]]


def _pieces(answer):
    """The parts of a scripted answer: reasoning, calls and the text between them."""
    pieces, rest = [], answer
    if rest.startswith("<think>"):
        end = rest.index("</think>") + len("</think>")
        pieces.append(rest[:end])
        rest = rest[end:]
    while rest:
        at = rest.find("<tool_call>")
        if at < 0:
            at = len(rest)
        if rest[:at].strip():
            pieces.append(rest[:at].strip())
        if at < len(rest):
            end = rest.index("</tool_call>") + len("</tool_call>")
            pieces.append(rest[at:end])
            rest = rest[end:]
        else:
            rest = ""
    return pieces
