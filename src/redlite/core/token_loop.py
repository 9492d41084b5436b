"""The two ways a generation gets its tokens, behind one small interface the generator drives.

Per token the :class:`~redlite.core.generation.Generator` calls ``next(ahead)``, looks at the
token (end of turn, stop sequences, limits), then ``keep(token)`` when the token belongs to
the held sequence (the generation goes on) or ``drop()`` when it does not (the generation
ends). ``ahead`` says the token may be fed before it is looked at (no limit ends the
generation at it). Between ``next`` and ``keep``/``drop`` the engine may hold one token more
than the generator's held ids; ``keep``/``drop`` end that, and the generator changes its held
ids in the same place.

* :class:`HostLoop`: the host samples from each step's logits; ``keep`` feeds the token
  (one engine decode); ``drop`` does nothing. Serves every request (logit rules, grammars,
  logprobs).
* :class:`StreamLoop`: over an engine :class:`~redlite.engine.base.TokenStream`: ``next``
  feeds the token before reading it when ``ahead`` (so the device computes the next step
  while the host reads, detokenizes and scans this one); ``drop`` undoes that feed.
"""

from __future__ import annotations

from typing import Any

from redlite.engine.base import Engine, Sampler, TokenLogprob, TokenStream


class HostLoop:
    """Host sampling: ``sampler`` on the logits ``engine.decode`` returns."""

    pipelined = False

    def __init__(self, engine: Engine, sampler: Sampler, logits: Any):
        self.engine, self.sampler, self.logits = engine, sampler, logits

    @property
    def last_logprob(self) -> TokenLogprob | None:
        return self.sampler.last_logprob

    def next(self, ahead: bool) -> int:
        return self.sampler.sample(self.logits)

    def keep(self, token: int) -> None:
        self.logits = self.engine.decode(token)

    def drop(self) -> None:
        pass


class StreamLoop:
    """Device sampling through ``stream``, one token ahead of the host."""

    pipelined = True
    last_logprob = None

    def __init__(self, stream: TokenStream):
        self.stream = stream
        self._fed = False

    def next(self, ahead: bool) -> int:
        if ahead:
            self.stream.feed()
            self._fed = True
        return self.stream.read()

    def keep(self, token: int) -> None:
        if not self._fed:  # the generator keeps only tokens it let run ahead
            raise RuntimeError("token kept that was not fed")
        self._fed = False

    def drop(self) -> None:
        if self._fed:
            self.stream.undo()
            self._fed = False
