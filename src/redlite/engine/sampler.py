"""The sampling contracts an engine offers: :class:`Sampler` (host-side, one request) and
:class:`TokenStream` (the engine samples on its device, one token ahead of the host).
No torch import."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from redlite.engine.sampling_params import TokenLogprob


class Sampler(ABC):
    """Picks the next token id from logits; holds the state of one request's sampling: its
    random generator, the token counts penalties need, the grammar matcher.

    ``last_logprob``: the :class:`TokenLogprob` of the token the last :meth:`sample` returned
    (None unless ``SamplingParams.logprobs`` is set).
    """

    last_logprob: TokenLogprob | None = None

    @abstractmethod
    def sample(self, logits: Any) -> int:
        """Return the next token id (an int in ``[0, vocab_size)``) for the given logits and
        record it as generated (penalty counts, grammar state)."""


class TokenStream(ABC):
    """Decoding run one token ahead of the host: the engine samples every token itself
    (on its device), so it can feed a token into the model before the host has read it.

    Opened by :meth:`Engine.token_stream` with the logits at the held state's end, it has
    sampled the first token. :meth:`feed` feeds the newest sampled token (``n_past`` grows
    by 1) and samples the one after it, without waiting; :meth:`read` returns the oldest
    sampled token the host has not read yet (blocking until it exists); :meth:`undo` takes
    back the last :meth:`feed` when its token turns out not to belong to the held sequence
    (end of turn, a stop sequence). The caller keeps its held ids in step: at most one fed
    token is not confirmed at a time.
    """

    @abstractmethod
    def feed(self) -> None:
        """Feed the newest sampled token at ``n_past`` and sample the next. Raises
        :class:`EngineError` on a full context."""

    @abstractmethod
    def read(self) -> int:
        """The oldest sampled token id not read yet (an int in ``[0, vocab_size)``)."""

    @abstractmethod
    def undo(self) -> None:
        """Undo the last :meth:`feed`: ``n_past`` and the state are as before it. Once per feed."""
