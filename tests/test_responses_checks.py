"""Responses requests against the OpenAI API's rules, in process (echo engine), through the
official ``openai`` SDK and raw HTTP: ``input_tokens`` counts prompts of any length; an answer
cut by ``max_output_tokens`` gives the same items streamed or not; ``include`` takes the API's
values only; a reasoning item's ``encrypted_content`` is redlite's own, intact, or ignored."""

import json

import openai
import pytest

from sdk_app import EchoApp


def sdk(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="dummy", http_client=app.client, max_retries=0)


@pytest.mark.timeout(30)
def test_input_tokens_counts_a_prompt_longer_than_the_context():
    """It was a 400 ``context_length_exceeded``: a count answers any length; creating the
    response is what refuses it. Other errors stay (an unknown previous response is a 404)."""
    with EchoApp(max_context=64) as small:
        client = sdk(small)
        counted = client.responses.input_tokens.count(model="m", input="y" * 200)
        assert counted.input_tokens > 64 and small.engine.prefilled_tokens == 0
        short = client.responses.input_tokens.count(model="m", input="y" * 20)
        assert counted.input_tokens - short.input_tokens == 180
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", input="y" * 200)
        assert info.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError):
            client.responses.input_tokens.count(model="m", input="y" * 200, previous_response_id="resp_gone")


TOOLS = [{"type": "function", "name": "shell",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}}]
CALL = "<tool_call>\n" + json.dumps({"name": "shell", "arguments": {"cmd": ["ls", "-la"]}}) + "\n</tool_call>"


def without_ids(items):
    """The items without their ids (item and call ids are new in every response)."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", [CALL, "Let me look." + CALL])
def test_a_call_cut_by_max_output_tokens_is_the_same_streamed_or_not(text):
    """The streamed response kept the cut call (``function_call``, status ``incomplete``, its
    arguments so far); the non-streamed one dropped it (an empty message instead when it was
    all). Both now end as OpenAI's do: status ``incomplete``, ``incomplete_details`` reason
    ``max_output_tokens``, the items so far, the cut call last and ``incomplete``."""
    with EchoApp() as app:
        cut_calls, start = 0, len(text) - len(CALL)
        limits = [3] + [start + k for k in (20, 40, 45, 50, 60)] + [len(text) + 5]
        for limit in limits:
            body = {"model": "m", "input": text, "tools": TOOLS, "max_output_tokens": limit}
            plain = app.client.post("/v1/responses", json=body).json()
            with app.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                frames = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                          if line.startswith("data: ")]
            streamed = frames[-1]["response"]
            assert frames[-1]["type"] == f"response.{streamed['status']}"
            assert (plain["status"], plain["incomplete_details"]) == \
                (streamed["status"], streamed["incomplete_details"]), limit
            assert without_ids(plain["output"]) == without_ids(streamed["output"]), limit
            done = [f["item"] for f in frames if f["type"] == "response.output_item.done"]
            assert without_ids(done) == without_ids(streamed["output"])
            calls = [item for item in plain["output"] if item["type"] == "function_call"]
            if plain["status"] == "completed":
                assert limit == limits[-1] and json.loads(calls[0]["arguments"]) == {"cmd": ["ls", "-la"]}
                continue
            assert plain["incomplete_details"] == {"reason": "max_output_tokens"}
            if calls:  # the cut call with its arguments so far, never parsed as a whole one
                assert calls == plain["output"][-1:] and calls[0]["name"] == "shell"
                assert calls[0]["status"] == "incomplete"
                assert '{"cmd": ["ls", "-la"]}'.startswith(calls[0]["arguments"])
                cut_calls += 1
        assert cut_calls == 3  # at 45 (no arguments yet), 50 and 60 characters into the call


@pytest.mark.timeout(30)
def test_include_takes_the_apis_values_only():
    """An ``include`` value outside the API's list (a typo, say) was accepted silently; now a 400
    naming the entry, on every route that takes ``include``. Every listed value is accepted
    (those naming items redlite never makes change nothing) and the list is the SDK's."""
    from typing import get_args

    from openai.types.responses import ResponseIncludable

    from redlite.server.responses_schemas import INCLUDABLE

    assert set(INCLUDABLE) == set(get_args(ResponseIncludable))
    with EchoApp() as app:
        client = sdk(app)
        response = client.responses.create(model="m", input="<think>\nhm\n</think>\n\nok",
                                           include=list(INCLUDABLE))
        assert response.output_text == "ok" and response.output[0].encrypted_content.startswith("rlr1.")
        assert response.output[1].content[0].logprobs == []
        bad = ["reasoning.encrypted_content", "reasoning.encrypted"]
        for path in ("/v1/responses", "/v1/responses/input_tokens"):
            r = app.client.post(path, json={"model": "m", "input": "x", "include": bad})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "include.1", error
            assert "'reasoning.encrypted_content'" in error["message"]
        r = app.client.get(f"/v1/responses/{response.id}/input_items", params={"include": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("include"), r.text
        assert len(client.responses.input_items.list(response.id, include=list(INCLUDABLE)).data) == 1


def reasoning_input(**fields):
    return [{"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [], **fields},
            {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
            {"role": "user", "content": "next"}]


@pytest.mark.timeout(30)
def test_encrypted_content_is_ours_intact_or_ignored(caplog):
    """``rlr1.`` + garbage was accepted silently (the reasoning dropped from the prompt): a token
    in redlite's format that does not decode is a 400 naming the field. A value of another
    server (OpenAI's own, from a conversation moved here) cannot be read by redlite: it is
    ignored, logged, and the item's own text is used, as without it."""
    from redlite.server.reasoning_token import encode_reasoning

    with EchoApp() as app:
        client = sdk(app)
        for token in ("rlr1.garbage!", "rlr1." + encode_reasoning("why")[5:-4]):
            for path in ("/v1/responses", "/v1/responses/input_tokens"):
                r = app.client.post(path, json={"model": "m", "input": reasoning_input(encrypted_content=token)})
                assert r.status_code == 400, (path, r.text)
                error = r.json()["error"]
                assert error["param"] == "input.1.encrypted_content", error
                assert "not a reasoning token this server gave" in error["message"], error
        text = [{"type": "reasoning_text", "text": "why"}]

        def count(**fields):
            return client.responses.input_tokens.count(model="m", input=reasoning_input(**fields)).input_tokens

        ours = count(encrypted_content=encode_reasoning("why"))
        assert ours == count(content=text) > count()
        with caplog.at_level("INFO", logger="redlite.server.responses"):
            assert count(encrypted_content="gAAAAABforeign", content=text) == ours
            assert count(encrypted_content="gAAAAABforeign") == count()
        assert any("encrypted_content" in m and "ignored" in m for m in caplog.messages), caplog.messages
        answer = client.responses.create(model="m", input=reasoning_input(encrypted_content="gAAAAABforeign"))
        assert answer.output_text == "next"
