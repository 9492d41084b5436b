"""Exact replay on real models (marked ``model``): the bundled SmolLM2 (a KV cache that can
rewind) and a tiny random Qwen3.5 hybrid (recurrent state: checkpoints only).

A sampled answer sent back as text re-tokenizes differently (SmolLM2's BPE merges differ
from the sampled path); with ``--replay exact`` the next turn is still a plain extension and
the greedy answer equals a cold ``--no-reuse`` server's given the same requests (so the same
kept turns); with ``--replay template`` the re-tokenized answer is a miss. On the hybrid, a
trimmed answer and a changed last message restore at most one message back.
"""

from __future__ import annotations

import httpx
import pytest

from server_process import ServerProcess
from test_hybrid_server import hybrid_dir  # noqa: F401  (the tiny Qwen3.5 fixture)

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def ask(server, messages, **fields):
    body = {"messages": messages, "temperature": 0, "max_tokens": 16, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=240)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = dict(out["usage"], finish=out["choices"][0]["finish_reason"])
    return out["choices"][0]["message"]["content"], usage


def sampled_session(server):
    """Turn 1 sampled (temperature 1, seed; the tokens 'se' and 'a' favoured by logit_bias, so
    the text 'sea...' re-tokenizes into other ids), sent back as text; turn 2 greedy. Returns
    (held after turn 1, turn-2 usage, turn-2 answer, turn-1 messages, turn-1 answer, its
    token count)."""
    first = [SYSTEM, {"role": "user", "content": "Write one short sentence about the sea."}]
    answer, usage1 = ask(server, first, temperature=1.0, seed=7, max_tokens=8,
                         logit_bias={"313": 100, "81": 100})
    # held: prompt + answer, less the last token when the answer hit max_tokens (not fed back)
    held = usage1["prompt_tokens"] + usage1["completion_tokens"] - (usage1["finish"] == "length")
    second = first + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": "Now one about the mountains."}]
    answer2, usage2 = ask(server, second)
    return held, usage2, answer2, first, answer, usage1["completion_tokens"]


def test_sampled_answer_sent_back_as_text_kv_model():
    with ServerProcess(engine="torch", timeout_s=300) as warm, \
            ServerProcess("--no-reuse", engine="torch", timeout_s=300) as cold, \
            ServerProcess("--replay", "template", engine="torch", timeout_s=300) as template:
        held, usage, answer, _, _, _ = sampled_session(warm)
        assert usage["prompt_tokens_details"]["cached_tokens"] == held
        _, cold_usage, cold_answer, _, _, _ = sampled_session(cold)
        assert cold_answer == answer and cold_usage["prompt_tokens"] == usage["prompt_tokens"]
        assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
        t_held, t_usage, _, _, _, _ = sampled_session(template)
        assert t_usage["prompt_tokens_details"]["cached_tokens"] < t_held  # re-tokenized: a miss
        print("exact cached", usage["prompt_tokens_details"]["cached_tokens"], "of held", held,
              "| template cached", t_usage["prompt_tokens_details"]["cached_tokens"], "of held", t_held)


def test_hybrid_trimmed_and_changed_restore_one_message_back(hybrid_dir):  # noqa: F811
    from redlite.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(hybrid_dir)
    common = ("--model", str(hybrid_dir), "--checkpoint-interval", "0")
    with ServerProcess(*common, engine="torch", timeout_s=300) as warm, \
            ServerProcess(*common, "--no-reuse", engine="torch", timeout_s=300) as cold:
        held, usage, answer, first, answer1, answer_ids = sampled_session(warm)
        assert usage["prompt_tokens_details"]["cached_tokens"] == held  # plain extension
        _, cold_usage, cold_answer, _, _, _ = sampled_session(cold)
        assert cold_answer == answer and cold_usage["prompt_tokens"] == usage["prompt_tokens"]
        first_prompt = len(tokenizer.render_chat(first).token_ids)

        # a trimmed answer: restore the checkpoint at the end of the previous prompt
        trimmed = first + [{"role": "assistant", "content": answer1[: len(answer1) // 2]},
                           {"role": "user", "content": "Now one about the mountains."}]
        got, usage = ask(warm, trimmed)
        assert got == ask(cold, trimmed)[0]
        assert usage["prompt_tokens_details"]["cached_tokens"] == first_prompt

        # a changed last message: restore at the end of the assistant turn (one message back)
        with_answer = first + [{"role": "assistant", "content": answer1}]
        ask(warm, with_answer + [{"role": "user", "content": "Now one about the mountains."}])
        ask(cold, with_answer + [{"role": "user", "content": "Now one about the mountains."}])
        changed = with_answer + [{"role": "user", "content": "Now one about rivers instead."}]
        got, usage = ask(warm, changed)
        assert got == ask(cold, changed)[0]
        # the boundary after the spliced answer ids + <|im_end|>\n
        assert usage["prompt_tokens_details"]["cached_tokens"] == first_prompt + answer_ids + 2
