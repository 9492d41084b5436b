"""Token sampling from torch logits: greedy, temperature, top-k, top-p, min-p.

Order (as Hugging Face ``generate``): divide by temperature, keep the top_k logits, keep the
smallest set of most likely tokens whose probability mass reaches top_p, keep tokens with
probability >= min_p * max probability, renormalise, draw with the request's
``torch.Generator``.
"""

from __future__ import annotations

import secrets

import torch

from redlite.engine.base import Sampler, SamplingParams


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
    seed and one request give one output.
    """

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=torch.device(device))
            self.generator.manual_seed(int(self.seed) % 2**64)

    def sample(self, logits: torch.Tensor) -> int:
        """Next token id (int) for ``logits`` ([vocab] float32)."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(filter_logits(logits.float(), self.params), -1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
