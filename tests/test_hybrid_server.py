"""A tiny random Qwen3.5 hybrid model served for real: forks restored from recurrent-state
checkpoints give byte-identical greedy answers to a cold ``--no-reuse`` server, and cached_tokens
equals the checkpoint position (hybrid-model issue, acceptance 2).

The model has random weights (float32) and borrows the bundled SmolLM2 tokenizer and chat
template (vocabulary 49152), so its "answers" are arbitrary but deterministic token streams.
"""

import re
import shutil

import httpx
import pytest

from redlite.core.reuse import common_prefix_length
from server_process import ServerProcess

pytestmark = pytest.mark.model
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    import torch

    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir

    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=4096, eos_token_id=2, tie_word_embeddings=True)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-qwen3_5")
    model.save_pretrained(path)
    source = resolve_model_dir(bundled_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def ask(server, messages):
    body = {"messages": messages, "temperature": 0, "max_tokens": 12}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_forks_through_checkpoints_match_cold_server(hybrid_dir):
    from redlite.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(hybrid_dir)
    # template replay: the boundaries below are the template's own (exact replay's splice is
    # tested on this model in tests/test_replay_model.py)
    common = ("--model", str(hybrid_dir), "--checkpoint-interval", "0", "--replay", "template")
    with ServerProcess(*common, engine="torch") as warm, \
            ServerProcess(*common, "--no-reuse", engine="torch") as cold:
        system = {"role": "system", "content": "You are a tiny random model."}
        turn1 = [system, {"role": "user", "content": "Tell me about lighthouses."}]
        answer1, _ = ask(warm, turn1)
        assert answer1 == ask(cold, turn1)[0]
        with_answer = turn1 + [{"role": "assistant", "content": answer1}]
        turn2 = with_answer + [{"role": "user", "content": "And about harbours?"}]
        answer2, cached = ask(warm, turn2)
        assert cached > 0
        assert answer2 == ask(cold, turn2)[0]

        # 1. edited last user message: restore the checkpoint at the end of the answer message
        edited = with_answer + [{"role": "user", "content": "And about ships instead?"}]
        boundary = tokenizer.render_chat(with_answer).message_ends[-1]
        answer, cached = ask(warm, edited)
        assert answer == ask(cold, edited)[0]
        assert cached == boundary
        assert f"restore from checkpoint at {boundary} of common" in warm.log()

        # 2. regenerated answer: the prompt ends at a checkpoint, nothing is prefilled
        prompt_len = len(tokenizer.render_chat(edited).token_ids)
        regenerated, cached = ask(warm, edited)
        assert (regenerated, cached) == (answer, prompt_len)
        last_prefill = [line for line in warm.log().splitlines() if " prefill " in line][-1]
        assert re.search(r" prefill 0 tok \(\d+ cached\)", last_prefill), last_prefill

        # 3. answer trimmed by the client: restore the turn boundary before the answer
        trimmed = edited + [{"role": "assistant", "content": answer[: len(answer) // 2]},
                            {"role": "user", "content": "Go on."}]
        answer3, cached = ask(warm, trimmed)
        assert answer3 == ask(cold, trimmed)[0]
        # the checkpoints of the edited turn sit at its message ends and its prompt end; the
        # re-rendered answer may tokenize differently right after "assistant\n", so the newest
        # checkpoint at or below the common prefix is the one restored
        edited_ids = tokenizer.render_chat(edited)
        trimmed_ids = tokenizer.render_chat(trimmed).token_ids
        shared = common_prefix_length(edited_ids.token_ids, trimmed_ids)
        expected = max(p for p in [*edited_ids.message_ends, prompt_len] if p <= shared)
        assert cached == expected
        assert expected >= boundary
        assert "reason=disabled" in cold.log()
