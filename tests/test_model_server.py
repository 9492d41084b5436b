"""End-to-end tests on the bundled SmolLM2-135M-Instruct model (CPU, float32, greedy)."""

import json

import httpx
import openai
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_server():
    with ServerProcess(engine="torch", timeout_s=300) as server:
        yield server


@pytest.fixture(scope="module")
def cold_model_server():
    with ServerProcess("--no-reuse", engine="torch", timeout_s=300) as server:
        yield server


def chat(server, messages, **fields):
    body = {"messages": messages, "temperature": 0, "max_tokens": 48, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_capital_of_france(model_server):
    reply = chat(model_server, QUESTION)
    assert "Paris" in reply["choices"][0]["message"]["content"]
    assert reply["model"] == "SmolLM2-135M-Instruct.Q4_1"
    log = model_server.log()
    assert "parameters" in log and "cold start" in log


def test_openai_client_on_the_model(model_server):
    client = openai.OpenAI(base_url=model_server.url + "/v1", api_key="unused")
    whole = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=24)
    streamed = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=24,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    completion = client.completions.create(model="m", prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert completion.choices[0].text
    assert completion.usage.completion_tokens <= 8


@pytest.mark.parametrize("prompt", [
    "Translate to French: I love the coffee shop and the summer.",
    "Repeat exactly: 🌊 海 café über",
    "Say hello in Japanese and in Chinese.",
])
def test_stream_equals_non_stream_on_the_model(model_server, prompt):
    messages = [{"role": "user", "content": prompt}]
    whole = chat(model_server, messages)["choices"][0]["message"]["content"]
    body = {"messages": messages, "temperature": 0, "max_tokens": 48, "stream": True}
    pieces = []
    with httpx.stream("POST", model_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    assert "\ufffd" not in delta
                    pieces.append(delta)
    assert "".join(pieces) == whole
    # each prompt makes this model write non-ASCII text (accents, emoji, CJK)
    assert any(ord(ch) > 127 for ch in whole), whole


def test_second_turn_reuses_state_and_matches_cold(model_server, cold_model_server):
    _warm_equals_cold(model_server, cold_model_server)


def test_float16_cache_second_turn_reuses_state_and_matches_cold():
    """``--kv-dtype float16``: the held rows are the rounded ones a cold prefill writes."""
    with ServerProcess("--kv-dtype", "float16", engine="torch", timeout_s=300) as warm, \
            ServerProcess("--kv-dtype", "float16", "--no-reuse", engine="torch", timeout_s=300) as cold:
        assert "KV cache float16" in warm.log()
        _warm_equals_cold(warm, cold)


def _warm_equals_cold(model_server, cold_model_server):
    results = {}
    for name, server in (("warm", model_server), ("cold", cold_model_server)):
        # a fresh conversation on each server (the system prompt differs from other tests)
        turn1 = [{"role": "system", "content": "You answer in one sentence."},
                 {"role": "user", "content": "Name a large river in Europe."}]
        first = chat(server, turn1)
        answer = first["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "How long is it?"}]
        second = chat(server, turn2)
        # and a fork: the last user message edited (a rewind on this KV-cache model)
        fork = turn1 + [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "Which countries does it cross?"}]
        third = chat(server, fork)
        results[name] = (answer, second, third)
    warm, cold = results["warm"], results["cold"]
    assert warm[0] == cold[0]
    assert warm[1]["choices"][0]["message"]["content"] == cold[1]["choices"][0]["message"]["content"]
    assert warm[2]["choices"][0]["message"]["content"] == cold[2]["choices"][0]["message"]["content"]
    assert warm[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "action=rewind" in model_server.log()
