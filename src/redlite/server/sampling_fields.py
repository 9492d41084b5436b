"""Request fields -> :class:`~redlite.engine.base.SamplingParams` (both OpenAI surfaces).

Rules (OpenAI API reference; vLLM for the extensions and limits):

* ``temperature`` (default 1), ``top_p``, ``top_k`` (<= 0 disables), ``min_p``, ``seed``.
* ``logit_bias``: ``{"token id": bias}``; a key that is not a token id of the served model is a
  400 naming ``logit_bias``; bias in [-100, 100] (the schema checks).
* ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] over the generated tokens;
  ``repetition_penalty`` > 0 over prompt + generated tokens (1 disables).
* chat: ``logprobs: true`` reports the chosen token's log-probability, ``top_logprobs`` (0-20)
  alternatives; ``top_logprobs`` without ``logprobs: true`` is a 400 (as OpenAI answers).
  Legacy completions: ``logprobs`` is an integer 0-20 (alternatives per token).
"""

from __future__ import annotations

from typing import Any

from redlite.engine.base import SamplingParams
from redlite.server.errors import APIError
from redlite.server.schemas import MAX_TOP_LOGPROBS


def logit_bias_of(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token_id, bias)`` pairs; 400 for a key that is not an id."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size or str(token) != key.strip():
            raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab_size})",
                           "logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def logprobs_of(body: Any, chat: bool) -> int | None:
    """How many alternatives per token to report (None: no logprobs)."""
    value = body.logprobs
    if chat:
        if value is not None and not isinstance(value, bool):
            raise APIError(400, "logprobs must be a boolean for chat completions", "logprobs")
        if body.top_logprobs is not None and not value:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (body.top_logprobs or 0) if value else None
    if body.top_logprobs is not None:
        raise APIError(400, "top_logprobs is a chat field; completions take logprobs: N", "top_logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return int(value)


def sampling_of(body: Any, vocab_size: int, chat: bool) -> SamplingParams:
    """The sampling settings of a validated chat or completions body (raises APIError 400)."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0), min_p=body.min_p or 0.0, seed=body.seed,
        logit_bias=logit_bias_of(body.logit_bias, vocab_size),
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        logprobs=logprobs_of(body, chat))
