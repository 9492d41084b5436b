"""The logit adjustment rules of a request, shared by every engine's sampler (numpy, torch-free).

One place per rule (the order is the one :class:`~redlite.engine.base.SamplingParams` states):

1. ``logit_bias``: the bias is added to the token's logit (OpenAI).
2. ``repetition_penalty`` r over the prompt and the generated tokens (the CTRL paper's rule as
   Hugging Face ``RepetitionPenaltyLogitsProcessor`` and vLLM apply it): a positive logit is
   divided by r, a negative one multiplied by r.
3. ``frequency_penalty`` / ``presence_penalty`` over the generated tokens (OpenAI's definition):
   ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
4. The grammar mask: forbidden tokens get ``-inf``.

Penalties touch only the tokens seen so far, so :class:`TokenHistory` keeps those ids and the
rules work on the small gathered vectors; a sampler gathers, calls :func:`penalize`, scatters.
:class:`NumpySampler` applies the whole pipeline to a numpy logits vector (the echo engine's).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from redlite.engine.base import Sampler, SamplingParams, TokenLogprob


class TokenHistory:
    """The token ids penalties look at: which appeared in the prompt (only tracked when
    ``repetition_penalty`` is on) and how often each was generated."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.params = params
        self._index: dict[int, int] = {}
        self._ids: list[int] = []
        self._counts: list[int] = []
        self._cache: tuple[np.ndarray, np.ndarray] | None = None
        if params.repetition_penalty != 1.0:
            for token in prompt_ids:
                self._slot(int(token))

    def _slot(self, token: int) -> int:
        slot = self._index.get(token)
        if slot is None:
            slot = self._index[token] = len(self._ids)
            self._ids.append(token)
            self._counts.append(0)
        return slot

    def add(self, token: int) -> None:
        """Record one generated token."""
        self._counts[self._slot(int(token))] += 1
        self._cache = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [k], generated counts float32 [k])`` of every token seen (prompt tokens
        with count 0 included when the repetition penalty is on)."""
        if self._cache is None:
            self._cache = (np.asarray(self._ids, dtype=np.int64),
                           np.asarray(self._counts, dtype=np.float32))
        return self._cache


def penalize(values: np.ndarray, counts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rules 2 and 3 on gathered logits: ``values`` float32 [k] of the tokens whose generated
    counts are ``counts`` [k] (every one of them is in the context). Returns a new array."""
    out = values.astype(np.float32, copy=True)
    r = params.repetition_penalty
    if r != 1.0:
        out = np.where(out > 0, out / r, out * r).astype(np.float32)
    if params.frequency_penalty or params.presence_penalty:
        out -= counts * params.frequency_penalty + (counts > 0) * np.float32(params.presence_penalty)
    return out


def bias_arrays(params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """``logit_bias`` as ``(ids int64 [k], biases float32 [k])``."""
    ids = np.asarray([t for t, _ in params.logit_bias], dtype=np.int64)
    bias = np.asarray([b for _, b in params.logit_bias], dtype=np.float32)
    return ids, bias


def top_logprobs(logprobs: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` largest entries of a log-probability vector, most likely first (lowest id on
    ties), as ``(token_id, logprob)`` pairs."""
    if k <= 0:
        return ()
    k = min(k, logprobs.shape[-1])
    part = np.argpartition(-logprobs, k - 1)[:k]
    order = part[np.lexsort((part, -logprobs[part]))]
    return tuple((int(i), float(logprobs[i])) for i in order)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Natural-log softmax of a float vector (float64 for exact small probabilities)."""
    x = x.astype(np.float64)
    finite = x[np.isfinite(x)]
    top = finite.max() if finite.size else 0.0
    return x - (top + math.log(np.exp(x - top).sum()))


class NumpyProcessor:
    """Rules 1-4 on numpy logits ([vocab] float) for one request; ``record(token)`` after each
    sampled token. ``constraint``: a grammar matcher (``allowed(vocab) -> bool [vocab]``,
    ``accept(token)``) or None. Used by the echo engine and by the torch sampler on CPU (numpy
    runs these small vector operations on one thread, free of thread-pool stalls)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), constraint=None):
        self.params = params
        self.history = TokenHistory(params, prompt_ids) if params.adjusts_logits else None
        self.penalties = params.repetition_penalty != 1.0 or bool(params.frequency_penalty) \
            or bool(params.presence_penalty)
        self.bias = bias_arrays(params) if params.logit_bias else None
        self.constraint = constraint

    @property
    def active(self) -> bool:
        """Whether any rule changes the logits."""
        return self.bias is not None or self.penalties or self.constraint is not None

    def process(self, logits: np.ndarray) -> np.ndarray:
        """Logits after rules 1-4 (a new float32 array)."""
        x = np.array(logits, dtype=np.float32, copy=True)
        if self.bias is not None:
            np.add.at(x, self.bias[0], self.bias[1])
        if self.penalties and self.history is not None:
            ids, counts = self.history.arrays()
            if ids.size:
                x[ids] = penalize(x[ids], counts, self.params)
        if self.constraint is not None:
            x[~self.constraint.allowed(x.shape[-1])] = -np.inf
        return x

    def record(self, token: int) -> None:
        if self.history is not None:
            self.history.add(token)
        if self.constraint is not None:
            self.constraint.accept(token)


class NumpySampler(Sampler):
    """A sampler over numpy logits ([vocab] float): rules 1-4, then argmax (lowest id on ties).

    It is greedy whatever the temperature: the echo engine it serves answers deterministically."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), constraint=None):
        self.params = params
        self.processor = NumpyProcessor(params, prompt_ids, constraint)
        self.constraint = constraint
        self.last_logprob = None

    def sample(self, logits: np.ndarray) -> int:
        token = int(np.argmax(self.processor.process(logits)))
        if self.params.logprobs is not None:
            lp = log_softmax(np.asarray(logits))
            self.last_logprob = TokenLogprob(token, float(lp[token]), top_logprobs(lp, self.params.logprobs))
        self.processor.record(token)
        return token
