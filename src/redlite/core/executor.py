"""The one thread that runs every engine call of a pool of sequence slots, batching decodes.

With ``--parallel N`` > 1 each running request keeps its generation loop in a lane thread
(:mod:`redlite.core.scheduler`); its generator talks to a :class:`SlotProxy` instead of the
engine. The proxy forwards every call to the :class:`EngineExecutor`, which runs them on its
own thread, in order:

- a decode step of a slot waits until every slot that is decoding has posted its next token
  (or ``batch_wait_s`` has passed since the first one did), then all of them run as one
  :meth:`~redlite.engine.base.Engine.decode_batch`, the slots always in the order their
  proxies were made (the same set of slots is the same batch step after step, which an
  engine's CUDA graph per set of slots needs);
- any other call (a prefill chunk, a sampling step, a snapshot, a rewind) runs as soon as it
  is posted, between two decode batches: a long prefill, sent chunk by chunk by the
  generator (``--prefill-chunk``), holds the others' next token back by at most one chunk.
  After a call, the same thread's next call (posted within :data:`STICKY_S`) goes before the
  next batch, unless both are prefill chunks: a request's start (choosing its conversation,
  a park, a rewind, its prefill, its first token) waits for one batch, not one per step.

A decode batch refused for a full context (EngineError, nothing changed) runs again slot by
slot, so only the full slot's request gets the error. Any other failure of a batch reaches
every slot in it (each generator then marks its state untrusted).

Once :meth:`EngineExecutor.close` has ended the thread, calls run on the caller's thread
(saving conversations at stop).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from redlite.engine.base import Engine, EngineError, Sampler

log = logging.getLogger("redlite.executor")

BATCH_WAIT_S = 0.05  # the longest a posted decode waits for the other decoding slots
STICKY_S = 0.002  # after a call, how long its thread's next call has priority


class EngineExecutor:
    """Runs engine calls of the slots of one pool (``pool``: the engine whose
    ``decode_batch`` serves them all) on one thread. Counters for tests and the bench:
    ``batches`` (decode_batch calls) and ``batched_tokens`` (decodes in them)."""

    def __init__(self, pool: Engine, batch_wait_s: float = BATCH_WAIT_S) -> None:
        self.pool = pool
        self.batch_wait_s = batch_wait_s
        self._cond = threading.Condition()
        # (the call, its future, the calling thread, whether it is a prefill chunk)
        self._calls: collections.deque[tuple[Callable[[], Any], Future, Any, bool]] = collections.deque()
        # (thread, until when, its last call was a prefill): its next call is served first
        self._sticky: tuple[Any, float, bool] | None = None
        self._decodes: dict[SlotProxy, tuple[int, Future]] = {}
        self._first_decode = 0.0
        self._decoding: set[SlotProxy] = set()
        self._closing = False
        self.batches = 0
        self.batched_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="engine-executor", daemon=True)
        self._thread.start()

    # --- from the lane threads ---------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the executor thread; return its result or raise its
        exception."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn(*args, **kwargs)
        future: Future = Future()
        with self._cond:
            prefill = getattr(fn, "__name__", "") == "prefill"
            self._calls.append((lambda: fn(*args, **kwargs), future, threading.current_thread(),
                                prefill))
            self._cond.notify_all()
        return future.result()

    def decode(self, proxy: "SlotProxy", token_id: int) -> Any:
        """``proxy``'s slot decodes ``token_id`` in the next batch; returns its logits."""
        if not self._thread.is_alive():
            return proxy.target.decode(token_id)
        future: Future = Future()
        with self._cond:
            if self._sticky is not None and self._sticky[0] is threading.current_thread():
                self._sticky = None
            if not self._decodes:
                self._first_decode = time.monotonic()
            self._decodes[proxy] = (int(token_id), future)
            self._decoding.add(proxy)
            self._cond.notify_all()
        return future.result()

    def rest(self, proxy: "SlotProxy") -> None:
        """``proxy``'s slot posts no more decodes for now (its generation ended): batches do not
        wait for it."""
        with self._cond:
            self._decoding.discard(proxy)
            self._cond.notify_all()

    def close(self, wait_s: float = 4.0) -> bool:
        """Run what was posted, end the thread (later calls run on the caller's thread); True
        when it has ended within ``wait_s`` seconds."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, wait_s))
        return not self._thread.is_alive()

    # --- the executor thread -----------------------------------------------------------------

    def _batch_ready(self, now: float) -> bool:
        if not self._decodes:
            return False
        return (self._decoding <= self._decodes.keys() or self._closing
                or now - self._first_decode >= self.batch_wait_s)

    def _next_sticky(self, now: float) -> tuple | None:
        """The sticky thread's next call, or None; waits are the caller's (holding the lock).
        Clears the stickiness when it has expired."""
        owner, until, after_prefill = self._sticky
        for index, item in enumerate(self._calls):
            if item[2] is owner:
                self._sticky = None
                if item[3] and after_prefill:  # chunk after chunk: a batch may go between
                    return None
                del self._calls[index]
                return item
        if now >= until:
            self._sticky = None
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._sticky is not None:
                        call = self._next_sticky(now)
                        if call is not None:
                            batch = None
                            break
                        if self._sticky is not None:
                            self._cond.wait(self._sticky[1] - now)
                            continue
                    if self._batch_ready(now):
                        batch, self._decodes = self._decodes, {}
                        call = None
                        break
                    if self._calls:
                        batch, call = None, self._calls.popleft()
                        break
                    if self._closing and not self._decodes:
                        return
                    timeout = None
                    if self._decodes:
                        timeout = max(0.0, self._first_decode + self.batch_wait_s - now)
                    self._cond.wait(timeout)
            if batch is not None:
                self._run_batch(batch)
                continue
            fn, future, owner, prefill = call
            _settle(future, fn)
            with self._cond:  # its next step (of the request's start) before the next batch
                self._sticky = (owner, time.monotonic() + STICKY_S, prefill)

    def _run_batch(self, batch: dict) -> None:
        # slots in a stable order (their making), not posting order: an engine keys what it
        # prepares for a set of slots (a CUDA graph) by their order
        proxies = sorted(batch, key=lambda proxy: proxy.order)
        tokens = [batch[p][0] for p in proxies]
        futures = [batch[p][1] for p in proxies]
        try:
            if len(proxies) == 1:
                results = [proxies[0].target.decode(tokens[0])]
            else:
                results = self.pool.decode_batch([p.target for p in proxies], tokens)
            self.batches += 1
            self.batched_tokens += len(proxies)
        except EngineError:  # a full context refused before any change: slot by slot
            for proxy, token, future in zip(proxies, tokens, futures):
                _settle(future, lambda: proxy.presample(proxy.target.decode(token)))
            return
        except BaseException as error:  # noqa: BLE001 - every slot in the batch hears of it
            log.exception("decode batch of %d slots failed", len(proxies))
            for future in futures:
                future.set_exception(error)
            return
        for proxy, future, result in zip(proxies, futures, results):
            proxy.presample(result)
            future.set_result(result)


def _settle(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
        future.set_exception(error)


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
    attributes read directly. No token streams: tokens are sampled per sequence on the host
    (the same seed and request give the same output whatever else runs)."""

    def __init__(self, target: Engine, executor: EngineExecutor) -> None:
        self.target = target
        self.executor = executor
        self.order = next(_MADE)  # batches list their slots by this
        self.sampler: _RemoteSampler | None = None  # the running request's, sampled after decodes

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
        return self.target.n_past

    def decode(self, token_id: int) -> Any:
        return self.executor.decode(self, token_id)

    def token_stream(self, params: Any, logits: Any) -> None:
        return None

    def make_sampler(self, params: Any, prompt_ids: Any = (), constraint: Any = None) -> Sampler:
        target = self.target
        self.sampler = _RemoteSampler(self.executor,
                                      lambda: target.make_sampler(params, prompt_ids, constraint))
        return self.sampler

    def presample(self, logits: Any) -> Any:
        """On the executor thread, after this slot's decode: sample its next token now (the
        generator samples every decode's logits exactly once, and the sampler is the
        request's alone). Returns ``logits``."""
        if self.sampler is not None:
            self.sampler.sample_now(logits)
        return logits

    def rest(self) -> None:
        """This slot's generation has ended (see :meth:`EngineExecutor.rest`)."""
        self.sampler = None
        self.executor.rest(self)
