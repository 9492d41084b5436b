"""Token sampling on the device, written so that it can run inside a captured CUDA graph.

Everything a request sets lives in device tensors (:class:`DeviceSampling`): filled once per
request, read by the kernels, never by the host; the random state is a counter the kernels
advance. So one graph serves every request of a mode, and the host never waits for a token
before launching the step that feeds it (see :mod:`redlite.engine.token_stream`).

Modes: ``greedy`` (argmax, lowest id on ties, as :class:`~redlite.engine.sampling.TorchSampler`)
and ``sample``: temperature, then top-k, top-p (over the top-k renormalised), min-p (relative
to the most likely token), the distribution the host sampler draws from; the draw is the
Gumbel-max trick with uniforms from a counter-based hash of ``(seed, step, token id)``, so one
seed gives one output (but not the host sampler's output: its random stream differs).
"""

from __future__ import annotations

import secrets

import torch

from redlite.engine.base import SamplingParams

GREEDY, SAMPLE = "greedy", "sample"
_MASK32 = 0xFFFFFFFF


def mode_of(params: SamplingParams) -> str | None:
    """``"greedy"`` or ``"sample"`` for params the device path serves exactly; None when a
    logit rule, a grammar or logprobs need the host sampler."""
    if params.needs_host:
        return None
    return GREEDY if params.greedy else SAMPLE


class DeviceSampling:
    """One request's sampling settings and random state as device tensors.

    ``floats``: float32 [3] = (1 / temperature, top_p (2.0 when off), min_p);
    ``ints``: int64 [3] = (top_k (vocab when off), seed (32 bits), step counter).
    """

    def __init__(self, device: torch.device | str, vocab: int):
        self.device, self.vocab = torch.device(device), int(vocab)
        self.floats = torch.zeros(3, dtype=torch.float32, device=self.device)
        self.ints = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.ranks = torch.arange(self.vocab, device=self.device)

    def set(self, params: SamplingParams) -> int:
        """Load ``params`` (seed None: a fresh random one) and zero the counter; returns the
        seed used. One small host-to-device copy."""
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        top_k = params.top_k if 0 < params.top_k < self.vocab else self.vocab
        top_p = params.top_p if params.top_p < 1.0 else 2.0
        inv_t = 1.0 / max(float(params.temperature), 1e-6)
        with torch.inference_mode():  # the tensors may be inference tensors (made in a warm-up)
            self.floats.copy_(torch.tensor([inv_t, top_p, params.min_p], dtype=torch.float32))
            self.ints.copy_(torch.tensor([top_k, int(seed) & _MASK32, 0], dtype=torch.int64))
        return int(seed)


def uniforms(ids: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1), one per id (int64 tensor), a hash of ``(seed, step, id)`` (int64
    0-d tensors). Products stay below 2**63 (32-bit values times 31-bit constants)."""
    x = (ids * 0x2545F491 + (step & 0xFFFFFF) * 0x6C8E9CF5 + seed) & _MASK32
    for mult in (0x7FEB352D, 0x5BD1E995, 0x27D4EB2F):
        x = x ^ (x >> 16)
        x = (x * mult) & _MASK32
    x = x ^ (x >> 15)
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_into(logits: torch.Tensor, out: torch.Tensor, mode: str, state: DeviceSampling) -> None:
    """Write the next token id of ``logits`` (float32 [1, vocab] or [vocab]) into ``out``
    (int64 [1]); advances ``state``'s counter. No host read, no data-dependent shapes."""
    x = logits.reshape(-1)
    if mode == GREEDY:
        out.copy_(torch.argmax(x).reshape(1))
        return
    f, n = state.floats, state.ints
    sorted_x, order = torch.sort(x * f[0], descending=True)
    ranks = state.ranks
    keep = ranks < n[0]                                     # top-k
    e = torch.exp(sorted_x - sorted_x[0]) * keep
    mass_before = (torch.cumsum(e, 0) - e) / e.sum()
    keep &= mass_before < f[1]                              # top-p over the top-k
    keep &= sorted_x - sorted_x[0] >= torch.log(f[2])       # min-p (log 0 = -inf: off)
    keep |= ranks == 0                                      # the most likely token stays
    gumbel = -torch.log(-torch.log(uniforms(order, n[1], n[2])))
    choice = torch.argmax((sorted_x + gumbel).masked_fill_(~keep, float("-inf")))
    out.copy_(order.gather(0, choice.reshape(1)))  # order[choice] would read choice on the host
    n[2:3].add_(1)
