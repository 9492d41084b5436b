"""Anthropic message threads (``thread: {"type": "create" | "continue"}``, the SDK's
``message-threads`` beta: the server holds the conversation and a ``continue`` sends only the new
messages, without ``system`` and ``tools``), in process (echo engine), through the official
``anthropic`` SDK: redlite holds no threads, so a request with ``thread`` is refused with the
rejection the SDK adapts to, and its tool runner goes on sending the whole conversation."""

import json

import anthropic
import pytest
from anthropic import beta_tool

from sdk_app import EchoApp


@pytest.fixture
def echo():
    with EchoApp() as app:
        yield app


def call_text(path):
    return "<tool_call>\n" + json.dumps({"name": "read_file", "arguments": {"path": path}}) + "\n</tool_call>"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
def test_the_sdk_tool_runner_sends_the_whole_conversation(echo, stream):
    """The runner threads by default: its second request held only the tool result (no history,
    no tools), which redlite answered as a new conversation (the echo repeated the call markup
    as text, and the loop ended there)."""
    client = anthropic.Anthropic(base_url=echo.url, api_key="dummy", http_client=echo.client, max_retries=0)
    reads = []

    @beta_tool
    def read_file(path: str) -> str:
        """Read a file."""
        reads.append(path)
        return call_text(f"f{len(reads)}.py") if len(reads) < 3 else "all read"

    runner = client.beta.messages.tool_runner(model="m", max_tokens=300, tools=[read_file], stream=stream,
                                              messages=[{"role": "user", "content": call_text("a.py")}])
    replies = [turn.get_final_message() if stream else turn for turn in runner]
    assert reads == ["a.py", "f1.py", "f2.py"]
    assert [reply.stop_reason for reply in replies] == ["tool_use"] * 3 + ["end_turn"]
    assert replies[-1].content[0].text == "all read"
    for before, after in zip(replies, replies[1:]):
        held = before.usage.input_tokens + before.usage.cache_read_input_tokens + before.usage.output_tokens - 1
        assert after.usage.cache_read_input_tokens >= held


@pytest.mark.timeout(30)
@pytest.mark.parametrize("thread", [{"type": "create"}, {"type": "continue", "previous_message_id": "msg_1"}])
def test_a_thread_is_refused_with_the_rejection_the_sdk_reads(echo, thread):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thread": thread}
    r = echo.client.post("/v1/messages", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("thread")
    assert error["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
    assert echo.client.post("/v1/messages", json=body | {"thread": None}).status_code == 200
