"""What a request asks of sampling (:class:`SamplingParams`) and the log-probability record of
one generated token (:class:`TokenLogprob`). Plain data: no torch import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (OpenAI ``temperature``/``top_p``/``seed`` fields,
    plus ``top_k`` and ``min_p`` as in llama.cpp and vLLM).

    temperature: 0 means greedy (argmax). top_k: 0 disables. top_p: 1.0 disables.
    min_p: 0.0 disables (keep tokens whose probability >= min_p * max probability).
    seed: None draws from a fresh random seed; the same seed and request give the same output.

    Logit adjustments, applied in this order before temperature and the filters (see
    :mod:`redlite.engine.logit_rules`):

    logit_bias: ``((token_id, bias), ...)``, bias in [-100, 100] added to that token's logit
        (OpenAI ``logit_bias``; -100 bans a token, 100 all but forces it).
    repetition_penalty: 1.0 disables; a token present in the prompt or the generated tokens
        gets ``logit / r`` when its logit is positive, ``logit * r`` otherwise (the CTRL rule,
        as Hugging Face and vLLM apply it, over prompt + generated tokens).
    frequency_penalty, presence_penalty: in [-2, 2]; OpenAI's definition over the generated
        tokens only: ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
    Then the constrained-decoding mask (tokens the grammar forbids get ``-inf``).

    logprobs: None (off) or how many most likely alternatives to report per generated token
        (0 = only the chosen token's log-probability). Reported log-probabilities are the
        model's own (log-softmax of the raw logits, before bias, penalties, mask and
        temperature), as vLLM reports by default.
    constraint: a :class:`redlite.core.constraints.ConstraintSpec` (grammar the output must
        follow) or None.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    constraint: Any = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether bias or a penalty changes the logits before sampling."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 \
            or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


    @property
    def needs_host(self) -> bool:
        """Whether sampling needs the host's view of the logits: a logit rule, a grammar or
        logprobs (a :class:`TokenStream` serves only requests without them)."""
        return self.adjusts_logits or self.constraint is not None or self.logprobs is not None


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability record of one generated token (when ``SamplingParams.logprobs`` is set).

    token_id: the chosen token. logprob: its natural-log probability under the model.
    top: the ``SamplingParams.logprobs`` most likely tokens as ``(token_id, logprob)``, most
        likely first (empty when 0 were asked for).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
