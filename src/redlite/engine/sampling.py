"""Token sampling from torch logits: logit bias, penalties, grammar mask, then greedy or
temperature, top-k, top-p, min-p.

The adjustments (bias, repetition/frequency/presence penalties, the constrained-decoding mask)
follow :mod:`redlite.engine.logit_rules` (one place for the rules); penalties gather the few
logits of tokens seen so far to the host, apply the rule, and scatter them back.

Then (as Hugging Face ``generate``): divide by temperature, keep the top_k logits, keep the
smallest set of most likely tokens whose probability mass reaches top_p, keep tokens with
probability >= min_p * max probability, renormalise, draw with the request's
``torch.Generator``.
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

import numpy as np
import torch

from redlite.engine.base import Sampler, SamplingParams, TokenLogprob
from redlite.engine.logit_rules import NumpyProcessor, penalize


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits ([vocab] float32) after temperature and the top_k/top_p/min_p filters:
    a new tensor with removed tokens at ``-inf`` (the most likely token always stays)."""
    x = logits / max(float(params.temperature), 1e-6)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        mass_before = torch.cumsum(probs, -1) - probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x


class TorchSampler(Sampler):
    """Sampler of one request over ``[vocab]`` float32 logits on ``device``.

    Greedy (argmax, lowest id on ties) when ``params.temperature <= 0``; otherwise draws from
    a ``torch.Generator`` seeded with ``params.seed`` (a fresh random seed when None), so one
    seed and one request give one output. ``prompt_ids``: counted by ``repetition_penalty``.
    ``constraint``: a grammar matcher (``allowed(vocab) -> numpy bool [vocab]``,
    ``accept(token)``) whose mask is applied before sampling.
    """

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu",
                 prompt_ids: Sequence[int] = (), constraint: Any = None):
        self.params = params
        self.device = torch.device(device)
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(int(self.seed) % 2**64)
        self.rules = NumpyProcessor(params, prompt_ids, constraint)
        self.host_rules = self.device.type == "cpu"  # False: the device-operation path
        self._bias = None
        self.last_logprob = None

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits after bias, penalties and the grammar mask (``logits`` itself when none
        applies, else a new float32 tensor). On CPU the rules run in numpy on the same memory;
        on an accelerator the bias and mask are device operations and only the penalised
        tokens' logits travel to the host and back."""
        rules = self.rules
        if not rules.active:
            return logits
        if self.host_rules:
            return torch.from_numpy(rules.process(logits.detach().float().cpu().numpy())).to(logits.device)
        x = logits.float().clone()
        if rules.bias is not None:
            if self._bias is None:
                self._bias = tuple(torch.from_numpy(a).to(self.device) for a in rules.bias)
            x.index_add_(0, self._bias[0], self._bias[1])
        if rules.penalties and rules.history is not None:
            ids, counts = rules.history.arrays()
            if ids.size:
                index = torch.from_numpy(ids).to(self.device)
                values = penalize(x[index].cpu().numpy(), counts, self.params)
                x[index] = torch.from_numpy(values).to(self.device)
        if rules.constraint is not None:
            allowed = torch.from_numpy(rules.constraint.allowed(x.shape[-1])).to(self.device)
            x.masked_fill_(~allowed, float("-inf"))
        return x

    def sample(self, logits: torch.Tensor) -> int:
        """Next token id (int) for ``logits`` ([vocab] float32); records it as generated."""
        x = self.process(logits)
        if self.params.greedy:
            token = int(np.argmax(x.numpy())) if x.device.type == "cpu" else int(torch.argmax(x))
        else:
            probs = torch.softmax(filter_logits(x.float(), self.params), -1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.params.logprobs is not None:
            self.last_logprob = logprob_record(logits, token, self.params.logprobs)
        self.rules.record(token)
        return token


def logprob_record(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The model's log-probability of ``token`` and its ``top`` most likely alternatives
    (log-softmax of the raw ``logits`` [vocab], in float32)."""
    lp = torch.log_softmax(logits.float(), -1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        alternatives = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(lp[token]), alternatives)
