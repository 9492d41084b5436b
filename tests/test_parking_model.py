"""Parking on the bundled SmolLM2 model: a conversation parked and restored from disk (also
across a restart) gives the same greedy answer as a cold server."""

import re

import httpx
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
A = [SYSTEM, {"role": "user", "content": "Name three things a lighthouse keeper did every night."}]
B = [SYSTEM, {"role": "user", "content": "Write a haiku about version control."}]


def chat(server, messages):
    body = {"messages": messages, "temperature": 0, "max_tokens": 40}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    reply = r.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def follow(messages, answer):
    return messages + [{"role": "assistant", "content": answer},
                       {"role": "user", "content": "Which of them was the hardest, and why?"}]


def test_restored_from_disk_answers_like_a_cold_server(tmp_path):
    args = ("--park-mib", "0", "--session-dir", str(tmp_path), "--session-min-tokens", "1",
            "--ctx-size", "2048")
    with ServerProcess("--no-reuse", "--ctx-size", "2048", engine="torch", timeout_s=300) as cold:
        answer_a, _ = chat(cold, A)
        answer_b, _ = chat(cold, B)
        expected_a, _ = chat(cold, follow(A, answer_a))
        expected_b, _ = chat(cold, follow(B, answer_b))
    with ServerProcess(*args, engine="torch", timeout_s=300) as warm:
        assert chat(warm, A)[0] == answer_a
        assert chat(warm, B)[0] == answer_b  # A goes to disk (no RAM pool)
        reply, cached = chat(warm, follow(A, answer_a))
        assert cached > 0
        assert re.search(r"restored from disk \d+ tok in [\d.]+ ms", warm.log())
        assert reply == expected_a
    # after a restart: B (saved on stop) is restored from disk
    with ServerProcess(*args, engine="torch", timeout_s=300) as restarted:
        reply, cached = chat(restarted, follow(B, answer_b))
        assert cached > 0 and "restored from disk" in restarted.log()
        assert reply == expected_b
