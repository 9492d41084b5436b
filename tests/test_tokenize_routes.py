"""llama.cpp's /tokenize, /detokenize and /apply-template on the echo app, in process."""

import pytest

from echo_app import echo_client
from redlite.core.byte_tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def client():
    with echo_client() as c:
        yield c


def test_tokenize_and_detokenize_round_trip(client):
    text = "Hello, wörld!"
    r = client.post("/tokenize", json={"content": text})
    assert r.status_code == 200
    assert r.json() == {"tokens": ByteTokenizer().encode(text)}
    back = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert back.status_code == 200 and back.json() == {"content": text}


def test_tokenize_with_pieces(client):
    r = client.post("/tokenize", json={"content": "aé", "with_pieces": True, "add_special": True})
    assert r.status_code == 200
    ids = ByteTokenizer().encode("aé")
    assert [t["id"] for t in r.json()["tokens"]] == ids
    assert r.json()["tokens"][0] == {"id": ids[0], "piece": "a"}
    assert all(isinstance(t["piece"], (str, list)) for t in r.json()["tokens"])


def test_apply_template_is_what_the_chat_route_feeds_the_model(client):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    r = client.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200
    assert r.json() == {"prompt": ByteTokenizer().render_chat(messages).text}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = client.post("/apply-template", json={"messages": messages, "tools": tools})
    assert with_tools.status_code == 200 and '"name": "f"' in with_tools.json()["prompt"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens.1"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/apply-template", {"messages": []}, "messages"),
])
def test_bad_bodies_are_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_json_only_and_documented(client):
    r = client.post("/tokenize", content=b"content=x", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/tokenize", "/detokenize", "/apply-template"):
        operation = paths[path]["post"]
        assert operation["requestBody"]["required"] is True
        assert set(operation["responses"]) >= {"200", "400", "415"}
        assert "422" not in operation["responses"]
