"""Anthropic bodies refused alike on POST /v1/messages and /v1/messages/count_tokens (echo engine,
in process): malformed or prefilled structured outputs (``output_config.format``, the beta's
``output_format``) and empty content lists."""

import pytest

from sdk_app import EchoApp

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def echo():
    with EchoApp() as app:
        yield app


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fields,needle", [
    ({"output_config": {"format": {"type": "json_schema", "schema": 5}}}, "output_config.format.schema"),
    ({"output_config": {"format": "json"}}, "output_config.format"),
    ({"output_config": []}, "output_config"),
    ({"output_format": {"type": "text"}}, "output_format.type"),
])
def test_malformed_output_format_is_a_400_on_both_routes(echo, fields, needle):
    """It was a 200 on count_tokens (the fields were ignored there) and a 400 on messages."""
    for path, extra in (("/v1/messages/count_tokens", {}), ("/v1/messages", {"max_tokens": 5})):
        r = echo.client.post(path, json={"model": "m", "messages": MESSAGES, **fields, **extra})
        assert r.status_code == 400, (path, r.text)
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert needle in error["error"]["message"], (path, error)


@pytest.mark.timeout(30)
def test_a_valid_output_format_counts_the_same_prompt(echo):
    """The schema constrains decoding and never enters the prompt: the count is unchanged."""
    fmt = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}
    plain = echo.client.post("/v1/messages/count_tokens", json={"model": "m", "messages": MESSAGES})
    counted = echo.client.post("/v1/messages/count_tokens",
                               json={"model": "m", "messages": MESSAGES, "output_config": {"format": fmt}})
    assert counted.status_code == plain.status_code == 200
    assert counted.json() == plain.json()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_a_prefill_with_an_output_format_is_a_400(echo, field):
    """The grammar starts after the prefill: ``{"name":`` + a whole new object was answered
    (invalid JSON); Anthropic's API refuses prefilling with structured outputs."""
    fmt = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}
    fields = {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    messages = MESSAGES + [{"role": "assistant", "content": '{"a":'}]
    for path, extra in (("/v1/messages/count_tokens", {}), ("/v1/messages", {"max_tokens": 5})):
        r = echo.client.post(path, json={"model": "m", "messages": messages, **fields, **extra})
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert "prefilled" in message and message.startswith(field), message
    r = echo.client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": MESSAGES, **fields})
    assert r.status_code == 200


@pytest.mark.timeout(30)
@pytest.mark.parametrize("messages,index", [
    ([{"role": "user", "content": []}], 0),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
      {"role": "user", "content": []}], 2),
])
def test_an_empty_content_list_is_a_400(echo, messages, index):
    """Anthropic's rule; such a message was dropped, so ``[{"role": "user", "content": []}]``
    counted and answered a prompt of no message at all. An empty assistant message stays allowed
    (an empty answer is sent back as ``[]``; last, it is no prefill)."""
    for path, extra in (("/v1/messages/count_tokens", {}), ("/v1/messages", {"max_tokens": 5})):
        r = echo.client.post(path, json={"model": "m", "messages": messages, **extra})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["message"].startswith(f"messages.{index}.content: ")
    for tail in ([{"role": "assistant", "content": []}],
                 [{"role": "assistant", "content": []}, {"role": "user", "content": "next"}]):
        ok = echo.client.post("/v1/messages/count_tokens", json={"model": "m", "messages": MESSAGES + tail})
        assert ok.status_code == 200, ok.text


@pytest.mark.timeout(30)
def test_two_different_output_formats_are_a_400(echo):
    """``output_config.format`` silently won over a different ``output_format``; the same one in
    both places is fine."""
    a = {"type": "json_schema", "schema": {"type": "object"}}
    b = {"type": "json_schema", "schema": {"type": "string"}}
    for path, extra in (("/v1/messages/count_tokens", {}), ("/v1/messages", {"max_tokens": 5})):
        body = {"model": "m", "messages": MESSAGES, "output_config": {"format": a}, **extra}
        r = echo.client.post(path, json={**body, "output_format": b})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("output_format and "), r.text
        assert echo.client.post(path, json={**body, "output_format": a}).status_code == 200
