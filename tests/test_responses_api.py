"""POST /v1/responses (and GET/DELETE of stored responses) in process (echo engine), through the
official ``openai`` SDK's ``responses`` API and raw HTTP. The echo engine answers with the last
user message."""

import json

import openai
import pytest

from inprocess import EchoApp


@pytest.fixture
def echo():
    with EchoApp() as app:
        yield app


def sdk(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="dummy", http_client=app.client, max_retries=0)


def test_previous_response_id_chain_reuses_everything(echo):
    client = sdk(echo)
    previous, last = None, None
    for turn, text in enumerate(["one", "two, longer", "three 🙂"]):
        fields = {"previous_response_id": previous} if previous else {}
        if turn == 1:
            with client.responses.stream(model="m", input=text, instructions="sys", **fields) as stream:
                for _ in stream:
                    pass
                response = stream.get_final_response()
        else:
            response = client.responses.create(model="m", input=text, instructions="sys", **fields)
        assert response.output_text == text and response.status == "completed"
        usage = response.usage
        if last is not None:
            # zero re-prefill of the history: everything up to the new input is reused
            assert usage.input_tokens_details.cached_tokens >= last.input_tokens + last.output_tokens - 1
        previous, last = response.id, usage
    stored = client.responses.retrieve(previous)
    assert stored.id == previous and stored.output_text == "three 🙂"


def test_store_false_with_replayed_input_items(echo):
    client = sdk(echo)
    items, last = [], None
    for text in ["alpha", "beta", "gamma"]:
        items.append({"role": "user", "content": [{"type": "input_text", "text": text}]})
        response = client.responses.create(model="m", input=items, store=False,
                                           include=["reasoning.encrypted_content"])
        assert response.output_text == text
        if last is not None:
            assert response.usage.input_tokens_details.cached_tokens >= last.input_tokens + last.output_tokens - 1
        last = response.usage
        items += [item.model_dump(exclude_none=True) for item in response.output]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_unknown_previous_response_is_a_404(echo):
    with pytest.raises(openai.NotFoundError) as info:
        sdk(echo).responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert info.value.body["code"] == "previous_response_not_found"
    r = echo.client.get("/v1/responses/resp_nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    ok = sdk(echo).responses.create(model="m", input="still serving")
    assert ok.output_text == "still serving"


def test_raw_stream_sequence_numbers_and_text(echo):
    body = {"model": "m", "input": "héllo", "stream": True, "max_output_tokens": 3}
    with echo.client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        frames = [f for f in r.read().decode().split("\n\n") if f]
    events = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    assert [f.split("\n")[0].removeprefix("event: ") for f in frames] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "hé" and events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_failure_is_response_failed(echo):
    body = {"model": "m", "input": "FAIL!", "stream": True}
    with echo.client.stream("POST", "/v1/responses", json=body) as r:
        frames = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1]["type"] == "response.failed"
    assert frames[-1]["response"]["status"] == "failed"
    assert frames[-1]["response"]["error"]["code"] == "engine_error"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "temperature": 9}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]}, "input.0.content.0"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_errors_in_openai_shape(echo, body, param):
    r = echo.client.post("/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_delete_stored_response(echo):
    client = sdk(echo)
    response = client.responses.create(model="m", input="keep me")
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
