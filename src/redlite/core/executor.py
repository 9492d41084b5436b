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
  is posted, between two decode batches (the calls posted during a batch run before the next
  one, even when every slot has already posted its next decode, as token streams do:
  :mod:`redlite.core.executor_stream`): a long prefill, sent chunk by chunk by the
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
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from redlite.engine.base import Engine, EngineError, Sampler
from redlite.engine.picks import resolve_picks

log = logging.getLogger("redlite.executor")

BATCH_WAIT_S = 0.05  # the longest a posted decode waits for the other decoding slots
STICKY_S = 0.002  # after a call, how long its thread's next call has priority


class EngineExecutor:
    """Runs engine calls of the slots of one pool (``pool``: the engine whose
    ``decode_batch`` serves them all) on one thread. Counters for tests and the bench:
    ``batches`` (decode_batch calls) and ``batched_tokens`` (decodes in them)."""

    def __init__(self, pool: Engine, batch_wait_s: float = BATCH_WAIT_S, decode_ahead: bool = True) -> None:
        self.pool = pool
        self.decode_ahead = bool(decode_ahead)  # slots may use ExecutorTokenStream (see SlotProxy)
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
        self._owed = 0  # calls to run before the next batch
        self.batches = 0
        self.batched_tokens = 0
        self._timing = _BatchTiming()
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

    @property
    def lock(self) -> threading.Condition:
        """The lock of the posted calls and decodes (for :mod:`redlite.core.executor_stream`)."""
        return self._cond

    @property
    def running(self) -> bool:
        """Whether the executor thread still runs calls (False once :meth:`close` has ended it)."""
        return self._thread.is_alive()

    def post_locked(self, proxy: "SlotProxy", token_id: int, future: Future) -> None:
        """Like :meth:`decode` without waiting: ``future`` gets the logits (the proxy samples
        them on this thread first). The caller holds :attr:`lock`."""
        if not self._decodes:
            self._first_decode = time.monotonic()
        self._decodes[proxy] = (int(token_id), future)
        self._decoding.add(proxy)
        self._cond.notify_all()

    def withdraw_locked(self, proxy: "SlotProxy") -> bool:
        """Take ``proxy``'s posted decode back if no batch has taken it yet (True), and stop
        waiting for the slot. The caller holds :attr:`lock`."""
        self._decoding.discard(proxy)
        self._cond.notify_all()
        return self._decodes.pop(proxy, None) is not None

    def rest(self, proxy: "SlotProxy") -> None:
        """``proxy``'s slot posts no more decodes for now (its generation ended): batches do not
        wait for it. A decode it posted ahead that still has to run (its token is held) runs
        first: this returns once it has."""
        with self._cond:
            self._decoding.discard(proxy)
            pending = self._decodes.get(proxy)
            self._cond.notify_all()
        if pending is not None and self._thread.is_alive():
            try:
                pending[1].result()
            except BaseException:  # noqa: BLE001 - the lane has heard of it (or will not care)
                pass

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
                    if self._owed and self._calls:  # calls posted during the last batch go first
                        self._owed -= 1
                        batch, call = None, self._calls.popleft()
                        break
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
                with self._cond:  # a slot's stream posts its next decode at once: no starving
                    self._owed = len(self._calls)
                continue
            fn, future, owner, prefill = call
            _settle(future, fn)
            with self._cond:  # its next step (of the request's start) before the next batch
                self._sticky = (owner, time.monotonic() + STICKY_S, prefill)

    def _run_batch(self, batch: dict) -> None:
        # slots in a stable order (their making), not posting order: an engine keys what it
        # prepares for a set of slots (a CUDA graph) by their order
        started = time.perf_counter()
        proxies = sorted(batch, key=lambda proxy: proxy.order)
        tokens = [batch[p][0] for p in proxies]
        futures = [batch[p][1] for p in proxies]
        targets = [p.target for p in proxies]
        try:
            if len(proxies) == 1:
                results = [targets[0].decode(resolve_picks(targets, tokens)[0])]
            else:
                results = self.pool.decode_batch(targets, tokens)
            self.batches += 1
            self.batched_tokens += len(proxies)
        except EngineError:  # a full context refused before any change: slot by slot
            for proxy, token, future in zip(proxies, tokens, futures):
                _settle(future, lambda: proxy.presample(
                    proxy.target.decode(resolve_picks([proxy.target], [token])[0])))
            return
        except BaseException as error:  # noqa: BLE001 - every slot in the batch hears of it
            log.exception("decode batch of %d slots failed", len(proxies))
            for future in futures:
                future.set_exception(error)
            return
        greedy = [i for i, proxy in enumerate(proxies) if proxy.plain_greedy] if len(proxies) > 1 else []
        handle = None
        if greedy:  # picked together, left on the device: the next step is queued without waiting
            try:
                handle = self.pool.greedy_batch_async([targets[i] for i in greedy], [results[i] for i in greedy])
            except Exception:  # noqa: BLE001 - each slot samples its own row instead
                log.exception("batched greedy pick failed")
        rows = {index: row for row, index in enumerate(greedy)} if handle is not None else {}
        for index, (proxy, future, result) in enumerate(zip(proxies, futures, results)):
            if index in rows:
                proxy.stream.on_pick(handle, rows[index])
            else:
                proxy.presample(result)
            future.set_result(result)
        self._timing.add(len(proxies), started, time.perf_counter())


class _BatchTiming:
    """Every ``every`` batches, a debug log line: mean slots per batch, mean host time of a
    batch call (launch, picks, hand-over) and mean time from one batch's start to the next."""

    def __init__(self, every: int = 200) -> None:
        self.every, self.n, self.slots, self.busy, self.first, self.last = every, 0, 0, 0.0, 0.0, 0.0

    def add(self, slots: int, started: float, ended: float) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        if self.n == 0:
            self.first = started
        self.n, self.slots, self.busy, self.last = self.n + 1, self.slots + slots, self.busy + ended - started, started
        if self.n >= self.every:
            log.debug("decode batches: %d, %.1f slots each, host %.2f ms each, one every %.2f ms",
                      self.n, self.slots / self.n, 1e3 * self.busy / self.n,
                      1e3 * (self.last - self.first) / max(1, self.n - 1))
            self.n, self.slots, self.busy = 0, 0, 0.0


def _settle(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
        future.set_exception(error)


from redlite.core.slot_proxy import SlotProxy  # noqa: E402,F401 - the executor's public pair
