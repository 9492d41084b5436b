"""--log-format json: the access log line as one JSON object with the request's fields."""

import json
import logging

from echo_app import echo_client
from redlite.cli import build_parser
from redlite.logformat import JsonFormatter


def test_access_line_as_json(caplog):
    with caplog.at_level(logging.INFO, logger="redlite.access"), echo_client() as client:
        first = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 3})
        second = client.post("/v1/completions", json={"prompt": "hello there, again", "max_tokens": 3})
        client.get("/v1/models")
    records = [r for r in caplog.records if r.name == "redlite.access"]
    lines = [json.loads(JsonFormatter().format(r)) for r in records]
    assert [line["path"] for line in lines] == ["/v1/completions", "/v1/completions", "/v1/models"]
    one, two, models = lines
    assert one["request_id"] == first.headers["x-request-id"]
    assert (one["prompt"], one["reused"], one["prefilled"], one["generated"]) == (11, 0, 11, 3)
    assert one["miss_reason"] == "empty" and one["session_key"] is None
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (two["prompt"], two["reused"], two["prefilled"]) == (18, cached, 18 - cached)
    assert two["ttft_ms"] >= 0 and two["status"] == 200 and two["level"] == "info"
    assert "prompt" not in models and models["status"] == 200
    assert one["message"].startswith("POST /v1/completions 200 ")


def test_log_format_option():
    parser = build_parser()
    assert parser.parse_args(["serve", "--engine", "echo"]).log_format == "text"
    assert parser.parse_args(["serve", "--log-format", "json"]).log_format == "json"
    assert parser.parse_args(["serve", "--no-metrics"]).metrics is False


def test_session_key_in_the_json_line(caplog):
    with caplog.at_level(logging.INFO, logger="redlite.access"), echo_client() as client:
        client.post("/v1/chat/completions", headers={"x-claude-code-session-id": "s-1"},
                    json={"messages": [{"role": "user", "content": "hi"}]})
    record = [r for r in caplog.records if r.name == "redlite.access"][-1]
    line = json.loads(JsonFormatter().format(record))
    assert line["session_key"] == "s-1" and line["generated"] == 2
