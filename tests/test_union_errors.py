"""A field that takes a string or a list names the list's own rule when a list was sent, and
an item tagged by ``type`` names its own missing field (in-process, echo engine)."""

from __future__ import annotations

import pytest

from echo_app import echo_client

USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/chat/completions", {"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop",
     "at most 4"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("/v1/responses", {"input": []}, "input", "at least 1"),
    ("/v1/chat/completions", {"messages": USER, "stop": 7}, "stop", "valid string"),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id", "Field required"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c"}]},
     "input.0.output", "Field required"),
])
def test_list_member_error_is_reported(path, body, param, fragment):
    with echo_client() as client:
        r = client.post(path, json=body)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == param
        assert fragment in error["message"], error["message"]
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "messages.0.content"),
    (USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c"}], "messages.2.content"),
])
def test_missing_content_is_refused_but_for_assistant(messages, param):
    with echo_client() as client:
        r = client.post("/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        ok = client.post("/v1/chat/completions", json={"messages": USER + [
            {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, prefix", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: "),
    ({"messages": USER, "tool_choice": {"type": "tool"}}, "tool_choice.name: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0: "),
])
@pytest.mark.timeout(60)
def test_anthropic_error_names_no_discriminator_tag(body, prefix):
    """The role / type value that picks a union member is no field: ``messages.0.content``,
    not ``messages.0.user.content``."""
    with echo_client() as client:
        r = client.post("/v1/messages", json={"model": "m", "max_tokens": 5, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(prefix), r.text


@pytest.mark.parametrize("path, body, param, tag", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_foo", "text": "x"}]}]},
     "messages.0.content.0.type", "input_foo"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "foo"}]}]},
     "input.0.output.0.type", "foo"),
    ("/v1/messages", {"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t", "content": []}]}]},
     "messages.0.content.0.type", "search_result"),
    ("/v1/messages", {"model": "m", "max_tokens": 3, "system": [{"type": "foo", "text": "x"}],
                      "messages": USER}, "system.0.type", "foo"),
])
@pytest.mark.timeout(60)
def test_a_block_of_an_unknown_type_names_its_type(path, body, param, tag):
    """A list item whose ``type`` matches no member (a block type the server does not take) is
    reported at its ``type``, naming the tag and the expected ones, not as the string the field
    could have been instead ("Input should be a valid string")."""
    with echo_client() as client:
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        body = r.json()
        message = body["error"]["message"]
        assert message.startswith(f"{param}: Input tag '{tag}'") and "expected tags" in message, message
        if path != "/v1/messages":
            assert body["error"]["param"] == param
        assert client.get("/health").status_code == 200
