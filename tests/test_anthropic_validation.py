"""Anthropic bodies refused alike on POST /v1/messages and /v1/messages/count_tokens (echo engine,
in process): malformed or prefilled structured outputs (``output_config.format``, the beta's
``output_format``) and empty content lists; only a prompt past the context is
counted by count_tokens and refused by messages."""

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


@pytest.mark.timeout(30)
def test_count_tokens_counts_a_prompt_longer_than_the_context():
    """The one rule the routes do not share: count_tokens was a 400 ``prompt is too long`` past
    the context; it counts (as Anthropic's does: the limit is the Messages call's concern). The
    other checks still apply to it (here a tool_choice naming no tool)."""
    from redlite.core.byte_tokenizer import ByteTokenizer

    long = [{"role": "user", "content": "y" * 200}]
    with EchoApp(max_context=64) as small:
        counted = small.client.post("/v1/messages/count_tokens", json={"model": "m", "messages": long})
        assert counted.status_code == 200, counted.text
        assert counted.json() == {"input_tokens": len(ByteTokenizer().render_chat(long).token_ids)}
        assert counted.json()["input_tokens"] > 64
        assert small.engine.prefilled_tokens == 0
        r = small.client.post("/v1/messages", json={"model": "m", "messages": long, "max_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long: ")
        bad = small.client.post("/v1/messages/count_tokens", json={
            "model": "m", "messages": long, "tool_choice": {"type": "tool", "name": "nope"},
            "tools": [{"name": "shell", "input_schema": {"type": "object"}}]})
        assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"], bad.text


@pytest.mark.model
@pytest.mark.timeout(60)
def test_count_routes_render_past_the_tokenizers_prompt_limit():
    """The bundled tokenizer with ``prompt_limit`` set, as the server sets it: its render refuses
    a provably long prompt before tokenizing (PromptTooLong) except for a count; through the
    routes the server's own bound (content characters over ``max_token_chars``) is skipped too."""
    from fastapi.testclient import TestClient

    from inprocess import inprocess_app
    from redlite.core.tokenizer import PromptTooLong, no_prompt_limit
    from redlite.engine.echo import EchoEngine
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_dir(bundled_model_path()))
    tok.prompt_limit = 64
    long = [{"role": "user", "content": "y" * 10000}]
    with pytest.raises(PromptTooLong):
        tok.render_chat(long)
    with no_prompt_limit():
        expected = len(tok.render_chat(long).token_ids)
    with inprocess_app(EchoEngine(max_context=64), tok) as (app, _), \
            TestClient(app, base_url="http://127.0.0.1") as client:
        r = client.post("/v1/messages/count_tokens", json={"model": "m", "messages": long})
        assert r.status_code == 200 and r.json() == {"input_tokens": expected}, r.text
        r = client.post("/v1/responses/input_tokens", json={"model": "m", "input": long[0]["content"]})
        assert r.status_code == 200 and r.json()["input_tokens"] == expected, r.text
        r = client.post("/v1/messages", json={"model": "m", "messages": long, "max_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long: ")
