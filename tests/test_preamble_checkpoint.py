"""Hybrid models (no rewind): a new conversation with the same system prompt and tools restores
the checkpoint at the end of system + tools (the preamble) instead of prefilling it again, also
after long conversations whose interior checkpoints were thinned to the budget. On the tiny
random Qwen3.5, in process."""

from __future__ import annotations

import pytest

from test_replay_tiny_models import SYSTEM, WRITE, ask, build_model_dir, server

pytestmark = pytest.mark.model
FIELDS = {"tools": [WRITE], "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 4}


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return build_model_dir("qwen3_5", tmp_path_factory)


def test_new_conversation_restores_the_preamble(hybrid_dir):
    with server(hybrid_dir) as warm:
        tokenizer = warm.state.tokenizer
        other = [SYSTEM, {"role": "user", "content": "A new conversation, same tools."}]
        preamble = tokenizer.render_chat(other, tools=[WRITE], enable_thinking=False).message_ends[0]
        history = [SYSTEM]
        for turn in range(4):
            history.append({"role": "user", "content": f"Step {turn}: " + "edit the file. " * 10})
            answer, usage, _ = ask(warm, history, **FIELDS)
            history.append({"role": "assistant", "content": answer.get("content") or ""})
            if turn == 0:  # room for 3 checkpoints: the interior ones get thinned from now on
                store = warm.state.worker.generator.checkpoints
                store.budget_bytes = 3 * store.items()[0].nbytes
        _, usage, _ = ask(warm, other, **FIELDS)
        print("checkpoints", warm.state.worker.generator.checkpoints.positions, "preamble", preamble)
        assert usage["prompt_tokens_details"]["cached_tokens"] == preamble
