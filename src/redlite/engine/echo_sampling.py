"""The echo engine's logits (:class:`EchoLogits`), its sampler and its token stream (see
:mod:`redlite.engine.echo` for what it predicts)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from redlite.core.byte_tokenizer import END, VOCAB_SIZE
from redlite.engine.base import EngineError, TokenStream
from redlite.engine.logit_rules import NumpySampler

if TYPE_CHECKING:
    from redlite.engine.echo import EchoEngine

_PREFERRED = {ord('"'): 1.0, ord("}"): 0.9, ord("]"): 0.8}


@dataclass(frozen=True)
class EchoLogits:
    """The echo engine's "logits": the one token it predicts next (see :meth:`scores`)."""

    next_token: int
    rest: bytes = b""  # the source bytes not echoed yet (a hint for constrained answers)
    vocab_size: int = VOCAB_SIZE

    def scores(self) -> np.ndarray:
        """float32 [vocab_size] logits (see the module docstring)."""
        x = -np.arange(self.vocab_size, dtype=np.float32) / 1000.0
        for token, value in _PREFERRED.items():
            x[token] = value
        if self.rest:
            rest = np.frombuffer(self.rest, dtype=np.uint8)
            x[rest] = 2.0 - rest.astype(np.float32) / 1000.0
        x[END] = 5.0
        x[self.next_token] = 10.0
        return x


class EchoSampler(NumpySampler):
    def sample(self, logits: EchoLogits) -> int:
        if not self.params.adjusts_logits and self.constraint is None and self.params.logprobs is None:
            return logits.next_token
        return super().sample(logits.scores())


class EchoStream(TokenStream):
    """The echo engine's token stream (``EchoEngine(pipelined=True)``): feeds run the decode
    at once, like a device that is always done; undo pops the fed token."""

    def __init__(self, engine: "EchoEngine", logits: EchoLogits):
        self.engine = engine
        self._unread = collections.deque([logits.next_token])
        self._newest = logits.next_token
        self._undo: int | None = None  # the answer position before the last feed

    def feed(self) -> None:
        before = self.engine._generated
        logits = self.engine.decode(self._newest)
        self._undo = before
        self._newest = logits.next_token
        self._unread.append(self._newest)
        self.engine.fed_ahead += 1

    def read(self) -> int:
        return self._unread.popleft()

    def undo(self) -> None:
        if self._undo is None:
            raise EngineError("nothing fed to undo")
        self.engine._held.pop()
        self.engine._generated, self._undo = self._undo, None
        self.engine.undone += 1
