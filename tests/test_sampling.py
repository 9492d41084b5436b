"""Sampling features on the engine side: logit bias, penalties, logprobs, n > 1 (in process,
echo engine and the torch sampler on hand-made logits)."""

import math

import numpy as np
import pytest
import torch

from redlite.core.byte_tokenizer import END, ByteTokenizer
from redlite.core.chat import OutputEvent
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.engine.base import SamplingParams, TokenLogprob
from redlite.engine.echo import EchoEngine, EchoLogits
from redlite.engine.logit_rules import log_softmax, penalize
from redlite.engine.sampling import TorchSampler

tok = ByteTokenizer()


def generate(text, engine=None, max_tokens=40, n=1, **params):
    engine = engine or EchoEngine()
    gen = Generator(engine, tok)
    prompt = tok.render_chat([{"role": "user", "content": text}]).token_ids
    request = GenerationRequest(prompt, max_tokens, SamplingParams(**params), n=n)
    items = list(gen.run(request))
    return items, gen, engine


def texts(items):
    out, current = [], []
    for item in items:
        if isinstance(item, OutputEvent):
            current.append(item.value)
        elif isinstance(item, GenerationResult):
            out.append(("".join(current), item))
            current = []
    return out


def test_logit_bias_bans_and_forces_tokens():
    (text, result), = texts(generate("aXb", logit_bias=((ord("X"), -100.0),))[0])
    assert text == "a" and result.finish_reason == "stop"  # <|end|> is the next best token
    (text, result), = texts(generate("abc", max_tokens=5, logit_bias=((ord("Z"), 100.0),))[0])
    assert text == "ZZZZZ" and result.finish_reason == "length"
    (text, _), = texts(generate("abc", logit_bias=((ord("c"), -100.0), (END, -100.0)))[0])
    assert text.startswith('ab"')  # then the echo's next preference, '"'


def test_penalty_rules_follow_openai_and_ctrl():
    values = np.array([2.0, -1.0, 0.5], dtype=np.float32)
    counts = np.array([3.0, 0.0, 1.0], dtype=np.float32)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    assert penalize(values, counts, p).tolist() == pytest.approx([2.0 - 1.5 - 0.25, -1.0, 0.5 - 0.5 - 0.25])
    r = SamplingParams(repetition_penalty=2.0)
    assert penalize(values, counts, r).tolist() == pytest.approx([1.0, -2.0, 0.25])


def torch_sampler(params, host_rules, **kwargs):
    sampler = TorchSampler(params, **kwargs)
    sampler.host_rules = host_rules  # False: the path an accelerator takes, run on CPU tensors
    return sampler


@pytest.mark.parametrize("host_rules", [True, False])
def test_torch_sampler_penalties_change_the_choice(host_rules):
    logits = torch.tensor([3.0, 2.9, 0.0, -5.0])
    TorchSampler = lambda params, **kw: torch_sampler(params, host_rules, **kw)  # noqa: E731, N806
    plain = TorchSampler(SamplingParams(temperature=0))
    assert [plain.sample(logits) for _ in range(3)] == [0, 0, 0]
    presence = TorchSampler(SamplingParams(temperature=0, presence_penalty=0.5))
    assert [presence.sample(logits) for _ in range(3)] == [0, 1, 0]  # both seen: 2.5 vs 2.4
    frequency = TorchSampler(SamplingParams(temperature=0, frequency_penalty=0.2))
    assert [frequency.sample(logits) for _ in range(4)] == [0, 1, 0, 1]
    # repetition penalty counts the prompt: token 0 is in it, 3.0 / 2 < 2.9
    repetition = TorchSampler(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[0, 3])
    assert repetition.sample(logits) == 1
    biased = TorchSampler(SamplingParams(temperature=0, logit_bias=((3, 10.0),)))
    assert biased.sample(logits) == 3


def test_torch_sampler_logprobs_are_the_models():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    sampler = TorchSampler(SamplingParams(temperature=0, logprobs=2, logit_bias=((0, 50.0),)))
    assert sampler.sample(logits) == 0
    record = sampler.last_logprob
    lp = torch.log_softmax(logits, -1)
    assert record.token_id == 0 and record.logprob == pytest.approx(float(lp[0]))
    assert [t for t, _ in record.top] == [2, 1]
    assert record.top[0][1] == pytest.approx(float(lp[2]))
    none = TorchSampler(SamplingParams(temperature=0))
    none.sample(logits)
    assert none.last_logprob is None


class _OnlyOdd:
    def __init__(self):
        self.accepted = []

    def allowed(self, vocab):
        return np.arange(vocab) % 2 == 1

    def accept(self, token):
        self.accepted.append(token)


@pytest.mark.parametrize("host_rules", [True, False])
def test_torch_sampler_applies_the_grammar_mask(host_rules):
    mask = _OnlyOdd()
    sampler = torch_sampler(SamplingParams(temperature=1.0, seed=3), host_rules, constraint=mask)
    logits = torch.tensor([9.0, 0.0, 9.0, 1.0, 9.0, 0.5])
    tokens = [sampler.sample(logits) for _ in range(30)]
    assert all(t % 2 == 1 for t in tokens) and mask.accepted == tokens
    assert len(set(tokens)) > 1  # it still samples among the allowed ones


def test_echo_logprobs_records_one_per_token():
    items, _, _ = generate("hey", logprobs=3)
    records = [i for i in items if isinstance(i, TokenLogprob)]
    (text, result), = texts(items)
    assert text == "hey" and [r.token_id for r in records] == list(b"hey")
    assert result.logprobs == records
    expected = log_softmax(EchoLogits(ord("h"), b"hey").scores())
    assert records[0].logprob == pytest.approx(float(expected[ord("h")]))
    assert [t for t, _ in records[0].top] == [ord("h"), END, ord("e")]  # then the rest of the source
    assert all(math.exp(lp) <= 1 for _, lp in records[0].top)
    # each record comes before the text its token completes
    assert isinstance(items[0], TokenLogprob) and items[1] == OutputEvent("content", "h")


@pytest.mark.parametrize("can_rewind", [True, False])
def test_n_choices_reuse_the_prompt(can_rewind):
    engine = EchoEngine(can_rewind=can_rewind)
    items, gen, _ = generate("choose me", engine=engine, n=3, temperature=0.7, seed=5)
    choices = texts(items)
    assert [r.index for _, r in choices] == [0, 1, 2]
    assert [t for t, _ in choices] == ["choose me"] * 3
    prompt = choices[0][1].prompt_tokens
    # a rewindable state rewinds to prompt - 1 and reads the last prompt token again for its
    # logits; a checkpointed one restores the checkpoint at the prompt's end (logits stored)
    again = 1 if can_rewind else 0
    assert [r.cached_tokens for _, r in choices] == [0, prompt - again, prompt - again]
    assert engine.prefilled_tokens == prompt + 2 * again
    assert gen.held_ids[:prompt] == tok.render_chat([{"role": "user", "content": "choose me"}]).token_ids


def test_n_choices_use_successive_seeds():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    draws = []
    for seed in (11, 12):
        sampler = TorchSampler(SamplingParams(temperature=1.5, seed=seed))
        draws.append([sampler.sample(logits) for _ in range(20)])
    assert draws[0] != draws[1]
