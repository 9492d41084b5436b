"""Forks on the torch engine with tiny random models (a Llama and a Qwen3.5 hybrid, CPU):
token ranges of the state round-trip exactly, and a fork parks only its tail while restoring
the old branch later gives the same greedy tokens as a cold engine."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from redlite.core.byte_tokenizer import VOCAB_SIZE, ByteTokenizer
from redlite.core.conversations import Conversations
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult, GeneratorSettings
from redlite.core.parking import LIVE, ParkingPool
from redlite.engine.base import EngineError, SamplingParams
from redlite.engine.torch_engine import TorchEngine

tok = ByteTokenizer()


def _random(model):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def llama():
    from redlite.models.llama import LlamaModel

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB_SIZE, max_position_embeddings=1024)
    return _random(LlamaModel(config.to_dict()))


def hybrid():
    from redlite.models.qwen3_5 import Qwen3_5Model

    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=1024)
    return _random(Qwen3_5Model(config.to_dict()))


MODELS = {"llama": llama, "hybrid": hybrid}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def engine_for(model):
    return TorchEngine(model, ctx_size=512)


def test_token_ranges_round_trip(model):
    engine = engine_for(model)
    ids = [(i * 7 + 3) % 250 for i in range(40)]
    engine.prefill(ids)
    expected = engine.decode(5)
    engine.reset()
    engine.prefill(ids[:25])
    engine.prefill(ids[25:])
    tail = engine.snapshot_range(25, on_device=True)
    assert tail.meta["range"] == [25, 40] and tail.meta["end_state"]
    assert tail.nbytes == engine.range_nbytes(25)
    head = engine.snapshot_range(0, 25)  # no end state: KV rows only
    assert not head.meta["end_state"] and set(head.tensors) == {"kv"}
    whole = engine.join_ranges([head, tail])
    assert whole.n_past == 40
    engine.reset()
    engine.prefill([1, 2, 3])
    with pytest.raises(EngineError):
        engine.restore_range(tail)  # 3 tokens held: the range starts at 25
    engine.restore(whole)  # a joined range from 0 is a whole snapshot
    assert torch.allclose(engine.decode(5), expected, atol=1e-5)
    engine.reset()
    engine.prefill(ids[:25] + [9, 9, 9])  # another branch on the same prefix
    engine.restore_range(tail)  # cut to 25, the tail written back (with its recurrent state)
    assert engine.n_past == 40
    assert torch.allclose(engine.decode(5), expected, atol=1e-5)
    part = engine.slice_range(whole, 10, 30)
    assert part.meta["range"] == [10, 30] and not part.meta["end_state"]


def run(gen, ids, max_tokens=10):
    request = GenerationRequest(list(ids), max_tokens=max_tokens,
                                sampling=SamplingParams(temperature=0.0))
    result = list(gen.run(request))[-1]
    assert isinstance(result, GenerationResult)
    return result


def generator(model, parking=True):
    gen = Generator(engine_for(model), tok, GeneratorSettings(checkpoint_interval=8))
    if parking:
        gen.parking = Conversations(ParkingPool(64 << 20, 8), None)
    return gen


def cold(model, ids):
    return run(generator(model, parking=False), ids).answer_ids


def test_fork_parks_the_tail_and_restores_like_cold(model, caplog):
    caplog.set_level(logging.INFO)
    gen = generator(model)
    engine = gen.engine
    a = [(i * 5 + 1) % 250 for i in range(50)]
    b = [(i * 11 + 2) % 250 for i in range(45)]
    first = run(gen, a)
    held_a = list(gen.held_ids)
    fork = a[:40] + [7, 8, 9]
    result = run(gen, fork)  # a fork: A's tail past the kept prefix is parked
    keep = result.cached_tokens
    [entry] = gen.parking.pool.entries()
    assert entry.parent == LIVE and entry.base == keep and entry.held_ids == held_a
    assert entry.snapshot.nbytes == engine.range_nbytes(0, len(held_a) - keep) + (
        0 if engine.can_rewind else engine.state.recurrent_nbytes())
    run(gen, b)  # another conversation: the live A branch is parked whole
    for branch, answer in ((a, first.answer_ids), (fork, result.answer_ids)):
        nxt = branch + answer + [3, 4]  # the client sends the answer back, then more
        warm = run(gen, nxt)
        assert warm.cached_tokens >= len(branch) + len(answer) - 1  # all that branch held
        assert warm.answer_ids == cold(model, nxt)
    assert "restored from ram" in caplog.text


def test_six_requests_park_tails_only(model, caplog):
    """The issue's scenario (two conversations, each answered, regenerated, then a second turn
    on a re-rendered answer): the pool holds the tails' bytes, not copies of shared prefixes."""
    caplog.set_level(logging.INFO)
    gen = generator(model)
    engine = gen.engine
    shared = [(i * 13 + 5) % 250 for i in range(20)]  # a system prompt
    parks, twice = [], 0  # per switch (held, kept); tokens a switch prefills again

    def step(ids, sampling=SamplingParams(temperature=0.0)):
        nonlocal twice
        held = len(gen.held_ids)
        result = list(gen.run(GenerationRequest(list(ids), max_tokens=10, sampling=sampling)))[-1]
        if held:
            parks.append((held, result.cached_tokens))
            twice += result.plan.common - result.cached_tokens
        return result

    for topic in (1, 2):
        prompt = shared + [(i * 7 + topic) % 250 for i in range(30 * topic)]
        first = step(prompt)
        again = step(prompt, SamplingParams(temperature=5.0, seed=topic))  # a sampled regenerate
        assert again.answer_ids != first.answer_ids
        step(prompt + again.answer_ids[:-3] + [4, 5, 6])  # the answer re-rendered, a new turn
    entries = gen.parking.pool.entries()
    assert len(entries) == 5 and all(e.is_tail for e in entries)
    assert sorted((len(e.held_ids), e.base) for e in entries) == sorted(parks)
    end_state = 0 if engine.can_rewind else engine.state.recurrent_nbytes()
    tails = [len(e.held_ids) - e.base for e in entries]
    state = sum(engine.range_nbytes(0, n) + end_state for n in tails)
    assert sum(e.snapshot.nbytes for e in entries) == state
    assert gen.parking.pool.nbytes == state + sum(c.nbytes for e in entries for c in e.checkpoints) \
        + 8 * sum(len(e.held_ids) for e in entries)
    whole = sum(engine.range_nbytes(0, len(e.held_ids)) + end_state for e in entries)
    assert state < whole / 2  # before issue 16 the pool held whole copies
    for held, keep in parks:
        assert f"parked {held - keep} tok" in caplog.text
    branches = {tuple(gen.held_ids[:i + 1]) for i in range(len(gen.held_ids))}
    branches |= {tuple(e.held_ids[:i + 1]) for e in entries for i in range(len(e.held_ids))}
    assert sum(tails) + len(gen.held_ids) == len(branches) + twice  # each shared prefix once
