"""Security defaults and well-formed errors of the HTTP layer, in process (echo engine ASGI app):
API keys, Host check, 415, CORS, request ids, strict types, unsupported fields, images, 405,
HEAD /health, /v1/models/{id}, body deadline, access log, no internal text in errors."""

import asyncio
import json
import logging
import stat

import pytest

from echo_app import echo_client
from redlite.core.private_files import make_private_dir, open_private
from redlite.server.errors import error_body, surface_of
from redlite.server.limits import BodyLimitMiddleware
from redlite.server.schemas import UNSUPPORTED_FIELDS
from redlite.server.security import SecurityOptions, host_name, is_json_type, read_key_file

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == r.headers["x-request-id"]
    assert error["param"] == param
    return error


# --- API keys -----------------------------------------------------------------------------------

def test_api_keys():
    with echo_client(security=SecurityOptions(api_keys=["k1", "k2"])) as c:
        assert c.get("/health").status_code == 200 and c.head("/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer nope"}, {"x-api-key": "k1x"},
                        {"authorization": "k1"}, {"authorization": "Basic k1"}):
            r = c.post(CHAT, json=HI, headers=headers)
            error = assert_openai_error(r, 401)
            assert error["code"] == "invalid_api_key"
        for path in ("/v1/models", "/v1/models/x", "/openapi.json"):
            assert c.get(path).status_code == 401
        assert c.post(CHAT, json=HI, headers={"authorization": "Bearer k2"}).status_code == 200
        assert c.post(CHAT, json=HI, headers={"x-api-key": "k1"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "bearer k1"}).status_code == 200


def test_api_keys_anthropic_surface_shape():
    with echo_client(security=SecurityOptions(api_keys=["k"])) as c:
        r = c.post("/v1/messages", json={})
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": r.json()["error"]["message"]},
                            "request_id": r.headers["x-request-id"]}


def test_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha\n\n  beta  \n")
    assert read_key_file(str(path)) == ["alpha", "beta"]
    path.write_text("\n# none\n")
    with pytest.raises(ValueError):
        read_key_file(str(path))


def test_warning_without_key_on_public_address(caplog):
    from redlite.cli import build_parser
    from redlite.server.security import security_from_args
    with caplog.at_level(logging.WARNING):
        options = security_from_args(build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    assert "without an API key" in caplog.text and not options.check_host
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        options = security_from_args(build_parser().parse_args(["serve", "--api-key", "k"]))
    assert caplog.text == "" and options.check_host and options.api_keys == ["k"]


# --- Host check, content type, CORS -------------------------------------------------------------

def test_host_check_defeats_dns_rebinding():
    with echo_client(security=SecurityOptions(check_host=True, allowed_hosts=["box.lan"])) as c:
        for host in ("localhost", "localhost:8080", "127.0.0.1:1", "[::1]:8080", "[::1]",
                     "LOCALHOST", "box.lan:80"):
            assert c.get("/health", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "",
                     "localhost.evil:80", "[::2]:80"):
            r = c.post(CHAT, json=HI, headers={"host": host})
            assert assert_openai_error(r, 403)["code"] == "invalid_host"
    assert host_name("[::1]:8080") == "[::1]" and host_name("Localhost:80") == "localhost"


@pytest.mark.parametrize("content_type,status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200), ("application/vnd.api+json", 200),
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415), (None, 415),
])
def test_json_routes_accept_only_json(content_type, status):
    headers = {"content-type": content_type} if content_type else {}
    with echo_client() as c:
        r = c.post(CHAT, content=json.dumps(HI).encode(), headers=headers)
        if content_type is None:
            r = c.post(CHAT, content=json.dumps(HI).encode(), headers={"content-type": ""})
        assert r.status_code == status, r.text
        if status == 415:
            assert_openai_error(r, 415)
    assert is_json_type("application/problem+json") and not is_json_type("text/json")


def test_cors_only_for_configured_origins():
    with echo_client() as c:
        r = c.get("/v1/models", headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        r = c.options(CHAT, headers={"origin": "http://evil.example",
                                     "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in r.headers
    with echo_client(security=SecurityOptions(cors_origins=["http://localhost:3000"],
                                              api_keys=["k"])) as c:
        r = c.options(CHAT, headers={"origin": "http://localhost:3000",
                                     "access-control-request-method": "POST",
                                     "access-control-request-headers": "authorization,content-type"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = c.options(CHAT, headers={"origin": "http://evil.example",
                                     "access-control-request-method": "POST"})
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"
        r = c.post(CHAT, json=HI, headers={"origin": "http://localhost:3000", "x-api-key": "k"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


# --- strict types, unsupported fields, images ---------------------------------------------------

@pytest.mark.parametrize("path,fields,param", [
    (CHAT, {"stream": "yes"}, "stream"),
    (CHAT, {"max_tokens": "10"}, "max_tokens"),
    (CHAT, {"max_tokens": 2.5}, "max_tokens"),
    (CHAT, {"stream_options": {"include_usage": 0}}, "stream_options.include_usage"),
    (CHAT, {"logit_bias": "z"}, "logit_bias"),
    (CHAT, {"temperature": "0.5"}, "temperature"),
    (CHAT, {"n": True}, "n"),
    (CHAT, {"seed": 1 << 70}, "seed"),
    (CHAT, {"stop": [1]}, "stop.0"),
    (CHAT, {"messages": [{"role": "user", "content": ["hi"]}]}, "messages.0.content.0"),
    ("/v1/completions", {"prompt": [True]}, "prompt.0"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
])
def test_strict_types_name_param(path, fields, param):
    body = {**({"prompt": "x"} if path != CHAT else HI), **fields}
    with echo_client() as c:
        assert_openai_error(c.post(path, json=body), 400, param)


def test_several_prompts_are_refused():
    with echo_client() as c:
        r = c.post("/v1/completions", json={"prompt": ["a", "b"]})
        assert_openai_error(r, 400, "prompt")
        assert "at most 1 item" in r.json()["error"]["message"]


def test_integral_numbers_are_integers():
    with echo_client() as c:
        r = c.post("/v1/completions", json={"prompt": list(b"abc"), "max_tokens": 2.0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("field,value", [("echo", True), ("best_of", 2), ("suffix", "x")])
def test_unsupported_fields_are_400_naming_them(field, value):
    assert field in UNSUPPORTED_FIELDS
    with echo_client() as c:
        for path, base in ((CHAT, HI), ("/v1/completions", {"prompt": "x"})):
            error = assert_openai_error(c.post(path, json={**base, field: value}), 400, field)
            assert error["code"] == "unsupported_field" and "not supported" in error["message"]


def test_off_values_and_ignored_fields_are_accepted():
    off = {"logprobs": False, "n": 1, "logit_bias": {}, "presence_penalty": 0,
           "frequency_penalty": 0.0, "response_format": {"type": "text"}, "user": "u", "metadata": {"a": "b"}, "store": False,
           "service_tier": "auto", "prompt_cache_key": "k", "parallel_tool_calls": True}
    with echo_client() as c:
        r = c.post(CHAT, json={**HI, **off})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": "x", "echo": False, "best_of": 1,
                                            "suffix": None, "logprobs": None})
        assert r.status_code == 200, r.text


def test_image_part_is_refused_with_param():
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    with echo_client() as c:
        error = assert_openai_error(c.post(CHAT, json=body), 400, "messages.0.content.1")
        assert "this model does not accept images" in error["message"]


# --- hostile bodies: 400, never a 500 or a text/plain answer -------------------------------------

@pytest.mark.parametrize("raw", [
    b'{"prompt": "\\ud800"}',                       # a lone surrogate
    b'{"prompt": "x\\udc00y", "max_tokens": 2}',
    b'{"prompt":' + b"[" * 3000 + b"]" * 3000 + b"}",  # nested 3,000 deep
    b"[" * 100000,
    b'{"prompt": "\xff\xfe"}',                      # not UTF-8
    b"", b"null", b"[]", b'"x"', b"{not json",
])
def test_hostile_bodies_are_400(raw):
    with echo_client() as c:
        r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400)
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_unexpected_exception_is_json_500_with_request_id(caplog):
    with echo_client() as c:
        def explode(*_):
            raise RuntimeError("secret /home/user/.cache/internal detail")
        c.state.tokenizer.render_chat = explode  # a bug in rendering: not a template refusal
        with caplog.at_level(logging.WARNING):
            r = c.post(CHAT, json=HI)
        error = assert_openai_error(r, 400, "messages")
        assert "secret" not in r.text and "/home" not in r.text
        # the log line names the request (chatcmpl-<hex> shares the hex of req_<hex>)
        assert "secret" in caplog.text and r.headers["x-request-id"][4:] in caplog.text
        c.state.tokenizer.encode = explode
        with caplog.at_level(logging.ERROR):
            r = c.post("/v1/completions", json={"prompt": "x"})
        error = assert_openai_error(r, 500)
        assert error["type"] == "server_error" and "secret" not in r.text
        assert "secret /home/user" in caplog.text


def test_engine_failure_hides_exception_text():
    with echo_client() as c:
        r = c.post(CHAT, json={"messages": [{"role": "user", "content": "FAIL! now"}]})
        error = assert_openai_error(r, 500)
        assert error["message"] == "generation failed" and "RuntimeError" not in r.text


# --- routes: 405 with Allow, HEAD /health, /v1/models/{id}, openapi ------------------------------

def test_405_carries_allow_and_head_health_works():
    with echo_client() as c:
        r = c.get(CHAT)
        assert_openai_error(r, 405)
        assert r.headers["allow"] == "POST"
        r = c.delete("/health")
        assert r.status_code == 405 and "GET" in r.headers["allow"]
        r = c.head("/health")
        assert r.status_code == 200 and r.content == b""
        assert_openai_error(c.get("/v1/nothing"), 404)


def test_model_by_id():
    import openai
    with echo_client() as c:
        for model_id in ("echo", "gpt-4o", "org/model-name"):
            r = c.get(f"/v1/models/{model_id}")
            assert r.status_code == 200
            assert r.json() == c.get("/v1/models").json()["data"][0]
        client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=c)
        assert client.models.retrieve("echo").id == "echo"


def test_openapi_documents_bodies_and_real_responses():
    with echo_client() as c:
        document = c.get("/openapi.json").json()
    paths = document["paths"]
    for path in (CHAT, "/v1/completions"):
        operation = paths[path]["post"]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        assert {"model", "stream", "max_tokens", "logprobs"} <= set(schema["properties"])
        assert schema["properties"]["echo"] == {"enum": [None, False]}
        assert "422" not in operation["responses"] and "401" not in operation["responses"]
        assert {"200", "400", "413", "415", "503"} <= set(operation["responses"])
    assert "prompt" in paths["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["required"]
    assert set(paths["/health"]) == {"get", "head"}
    assert "422" not in json.dumps(document)


# --- body deadline, access log -------------------------------------------------------------------

def test_body_deadline_bounds_the_whole_body():
    """A client trickling its body in chunks 50 ms apart (each well inside the limit) gets 408
    once the whole body has taken longer than the deadline."""
    sent = []

    async def app(scope, receive, send):
        raise AssertionError("the app must not see a body that came too late")

    async def trickle():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    async def send(message):
        sent.append(message)

    async def run():
        middleware = BodyLimitMiddleware(app, max_bytes=1 << 20, timeout_s=0.3)
        scope = {"type": "http", "method": "POST", "path": CHAT, "headers": []}
        loop = asyncio.get_running_loop()
        started = loop.time()
        await middleware(scope, trickle, send)
        return loop.time() - started

    elapsed = asyncio.run(asyncio.wait_for(run(), 5))
    assert sent[0]["status"] == 408 and 0.25 < elapsed < 1.0
    assert json.loads(sent[1]["body"])["error"]["message"] == "timed out reading the request body"


def test_access_log_has_one_line_per_request(caplog):
    with echo_client() as c, caplog.at_level(logging.INFO, logger="redlite.access"):
        r1 = c.post(CHAT, json=HI)
        r2 = c.get("/v1/nothing")
        r3 = c.post(CHAT, json={**HI, "max_tokens": "x"})
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "redlite.access"]
    assert len(lines) == 3
    ok, missing, bad = lines
    assert ok.startswith(f"POST {CHAT} 200 ") and f"id={r1.headers['x-request-id']}" in ok
    assert "prompt=5 reused=0 generated=2" in ok and " ms " in ok
    assert missing.startswith("GET /v1/nothing 404 ") and r2.headers["x-request-id"] in missing
    assert bad.startswith(f"POST {CHAT} 400 ") and "prompt=" not in bad
    assert r3.headers["x-request-id"] in bad


# --- error shapes, private files -----------------------------------------------------------------

def test_error_shape_is_picked_by_surface():
    assert surface_of("/v1/messages") == surface_of("/v1/messages/count_tokens") == "anthropic"
    assert surface_of("/v1/chat/completions") == surface_of("/v1/messagesx") == "openai"
    assert error_body(400, "m", "p", surface="anthropic", request_id="r") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "m"},
        "request_id": "r"}


def test_private_files_and_dirs(tmp_path):
    directory = make_private_dir(tmp_path / "a" / "sessions")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    path = directory / "x.bin"
    path.write_bytes(b"old")
    path.chmod(0o644)
    with open_private(path) as f:
        f.write(b"new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b"new"


def test_session_files_are_private(tmp_path):
    from redlite.core.session_file import write_state_file
    import numpy as np
    write_state_file(tmp_path / "s.rlsession", {"fingerprint": "f"}, {"x": np.zeros(4, np.float32)})
    assert stat.S_IMODE((tmp_path / "s.rlsession").stat().st_mode) == 0o600


def test_serve_help_prints_each_default_once():
    from redlite.cli import build_parser
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    formatter = serve._get_formatter()
    for action in serve._actions:
        if action.help:
            text = formatter._expand_help(action)
            assert text.count("default") <= 1, text
            assert "(default: None)" not in text and "(default: False)" not in text
    text = serve.format_help()
    assert "(default: 8080)" in text and "(default: 127.0.0.1)" in text


def test_server_process_deletes_its_log():
    from server_process import ServerProcess
    server = ServerProcess()
    log_path = server._log.name
    assert "listening on" in server.wait_for_log("listening on")
    assert "startup objects frozen out of the garbage collector's scans" in server.log()
    server.stop()
    assert not __import__("os").path.exists(log_path)
    assert "listening on" in server.log()  # still readable from memory after the stop


def test_startup_objects_are_frozen_out_of_full_collections():
    """A full collection walks every tracked object unless frozen: with the bundled model that
    is ~350k objects and ~0.5 s holding the GIL, a stall a few large requests trigger."""
    import gc

    from redlite.server.run import freeze_startup_objects
    startup = [object() for _ in range(3)] + [[] for _ in range(1000)]
    try:
        frozen = freeze_startup_objects()
        assert frozen >= len(startup) and gc.get_freeze_count() == frozen
        collected = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
        assert not any(id(x) in collected for x in startup[3:])  # none left for a collection
    finally:
        gc.unfreeze()
