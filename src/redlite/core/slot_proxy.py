"""A slot of the engine pool as its generator sees it (:class:`SlotProxy`), every call run
on the :class:`~redlite.core.executor.EngineExecutor` thread, and its host sampler
(:class:`_RemoteSampler`), run on that thread right after each decode batch."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable

from redlite.engine.base import Engine, Sampler

if TYPE_CHECKING:
    from redlite.core.executor import EngineExecutor


_MADE = itertools.count()


class _RemoteSampler(Sampler):
    """A slot's sampler, made and run on the executor thread (made in the step of the first
    token): after a decode batch, right
    away (:meth:`SlotProxy.presample`; its token is handed over when the generator asks for
    it, one thread switch per token), else (the first token, after a prefill) on request."""

    def __init__(self, executor: EngineExecutor, make: Callable[[], Sampler]) -> None:
        self._executor, self._make = executor, make
        self._sampler: Sampler | None = None  # made with the first token (in the same step)
        self.ahead: tuple[Any, int | None, BaseException | None] | None = None

    @property
    def last_logprob(self):  # type: ignore[override]
        return self._sampler.last_logprob if self._sampler is not None else None

    def _sample(self, logits: Any) -> int:
        if self._sampler is None:
            self._sampler = self._make()
        return self._sampler.sample(logits)

    def sample_now(self, logits: Any) -> None:
        """On the executor thread: sample ``logits`` and keep the token for :meth:`sample`."""
        try:
            self.ahead = (logits, self._sample(logits), None)
        except Exception as error:  # noqa: BLE001 - raised where the generator asks
            self.ahead = (logits, None, error)

    def sample(self, logits: Any) -> int:
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] is logits:
            if ahead[2] is not None:
                raise ahead[2]
            return ahead[1]
        return self._executor.call(self._sample, logits)


class SlotProxy:
    """One slot of the pool as its generator sees it: the :class:`~redlite.engine.base.Engine`
    interface of ``target``, every call run on ``executor``'s thread (decodes in batches),
    attributes read directly. Tokens are sampled per sequence on the host with the request's
    own sampler (the same seed and request give the same output whatever else runs), after
    each batch (:meth:`presample`) or, with the executor's ``decode_ahead``, by a
    :meth:`token_stream` that feeds them into the next batch at once."""

    def __init__(self, target: Engine, executor: EngineExecutor) -> None:
        self.target = target
        self.executor = executor
        self.order = next(_MADE)  # batches list their slots by this
        self.sampler: _RemoteSampler | None = None  # the running request's, sampled after decodes
        self.stream = None  # the running request's ExecutorTokenStream, if it has one

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.target, name)
        if not callable(value):
            return value
        executor = self.executor

        def forwarded(*args: Any, **kwargs: Any) -> Any:
            return executor.call(value, *args, **kwargs)

        return forwarded

    @property
    def n_past(self) -> int:
        stream = self.stream
        return stream.position if stream is not None else self.target.n_past

    def decode(self, token_id: int) -> Any:
        return self.executor.decode(self, token_id)

    def token_stream(self, params: Any, logits: Any) -> Any:
        """An :class:`~redlite.core.executor_stream.ExecutorTokenStream` (the next step
        posted by the executor as soon as it has sampled) when the slot's engine can rewind
        (a fed token that ends the answer is taken back by rewinding); else None."""
        if not (self.executor.decode_ahead and getattr(self.target, "can_rewind", False)):
            return None
        from redlite.core.executor_stream import ExecutorTokenStream

        self.sampler = None
        self.stream = ExecutorTokenStream(self, params, logits)
        return self.stream

    def make_sampler(self, params: Any, prompt_ids: Any = (), constraint: Any = None) -> Sampler:
        target = self.target
        self.stream = None
        self.sampler = _RemoteSampler(self.executor,
                                      lambda: target.make_sampler(params, prompt_ids, constraint))
        return self.sampler

    @property
    def plain_greedy(self) -> bool:
        """Whether this slot's next token is a greedy pick of its token stream, which the
        executor makes for the whole batch at once (leaving them on the device:
        :meth:`~redlite.core.executor_stream.ExecutorTokenStream.on_pick`). Host-sampled slots keep
        sampling one by one (their lanes wake one after another; see
        ``bench/results/concurrent-2026-12-02-nvidia-h200-host-greedy-batch.md``)."""
        return self.stream is not None and self.stream.greedy

    def presample(self, logits: Any) -> Any:
        """On the executor thread, after this slot's decode: sample its next token now (the
        generator samples every decode's logits exactly once, and the sampler is the
        request's alone). Returns ``logits``."""
        if self.stream is not None:
            self.stream.on_logits(logits)
        elif self.sampler is not None:
            self.sampler.sample_now(logits)
        return logits

    def rest(self) -> None:
        """This slot's generation has ended (see :meth:`EngineExecutor.rest`)."""
        self.executor.rest(self)
        self.sampler = self.stream = None
