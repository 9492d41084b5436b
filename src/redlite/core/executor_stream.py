"""A slot's :class:`~redlite.engine.base.TokenStream` on the engine executor: the next batch
step starts as soon as the tokens are sampled, while the lane threads detokenize and scan.

With ``--parallel N`` every slot's token goes through one batched decode step on the
:class:`~redlite.core.executor.EngineExecutor` thread. With host sampling alone
(:class:`~redlite.core.token_loop.HostLoop`), each step waits until every lane thread has
looked at its token and posted the next decode, so the device idles while N lanes run their
Python (tokenizer, stop scan, events) one after the other. This stream lets a lane run one
token ahead, as the single-sequence device stream does: :meth:`ExecutorTokenStream.feed`
grants the executor the right to feed the token the lane is about to read; the executor,
which samples each slot's token right after the step (:meth:`on_logits`), then posts that
token into the next batch at once, and the lane reads, detokenizes and scans it while the
device runs that step.

In a batch of several slots the greedy picks stay on the device
(:meth:`~redlite.engine.base.Engine.greedy_batch_async`): a stream whose next token is such
a pick feeds :data:`~redlite.engine.picks.PICKED`, so the executor queues the next step
before the device has finished this one, and the lane reads the id when it arrives
(:meth:`on_pick`).

Exactness is the token loop's (:class:`~redlite.core.token_loop.StreamLoop`): at most one fed
token is unconfirmed; a token that ends the answer is taken back with :meth:`undo` (the
posted decode is withdrawn if it has not run, else the slot rewinds one token), so it never
stays in the held state. Served only for engines that can rewind (the hybrid's recurrent
state cannot: it keeps host sampling). Sampling is the slot's own host sampler, the same one
host sampling uses, so a seeded request gives the same tokens either way.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any

from redlite.engine.base import EngineError, SamplingParams, TokenStream
from redlite.engine.picks import PICKED, PickHandle

READ_POLL_S = 0.5  # how often a waiting read checks that the executor is still running


class ExecutorTokenStream(TokenStream):
    """The stream of ``proxy`` (a :class:`~redlite.core.executor.SlotProxy`) for ``params``
    (no host rule: no logit rule, grammar or logprobs), starting from ``logits`` (the held
    state's last logits); samples the first token at once, on the executor thread.
    ``position``: the tokens the slot holds once every posted feed has run (what the
    generator must see as ``n_past``)."""

    def __init__(self, proxy, params: SamplingParams, logits: Any):
        self.proxy, self.executor = proxy, proxy.executor
        # sampled ids, (PickHandle, row) of picks still on the device, or errors; oldest first
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._unfed: int | None = None  # the newest sampled id, not fed yet
        self._on_device = False  # the newest token is a pick on the device, not fed yet
        self._credit = False  # feed the next sampled id as soon as it exists
        self.position = proxy.target.n_past
        self.greedy = bool(params.greedy)
        target = proxy.target
        self._sampler = self.executor.call(target.make_sampler, params)
        self.executor.call(self.on_logits, logits)

    # --- the executor thread -------------------------------------------------------------

    def on_logits(self, logits: Any) -> None:
        """After the step that fed this slot's last token: sample the next token (then as
        :meth:`on_token`)."""
        try:
            token = int(self._sampler.sample(logits))
        except Exception as error:  # noqa: BLE001 - raised where the lane reads
            self._tokens.put(error)
            return
        self.on_token(token)

    def on_token(self, token: int) -> None:
        """The next token, sampled on the host (:meth:`on_logits`); fed into the next batch at
        once when the lane has already granted it (:meth:`feed`)."""
        with self.executor.lock:
            if self._credit:
                self._credit = False
                self._post(token)
            else:
                self._unfed = token
        self._tokens.put(token)

    def on_pick(self, handle: PickHandle, row: int) -> None:
        """After a batch step: this slot's next token is row ``row`` of ``handle``, still on the
        device; fed (as :data:`PICKED`) into the next batch at once when the lane has granted
        it, else when it does (:meth:`feed`)."""
        with self.executor.lock:
            if self._credit:
                self._credit = False
                self._post(PICKED)
            else:
                self._on_device = True
        self._tokens.put((handle, row))

    def on_error(self, future: Future) -> None:
        """A posted decode failed: the lane's read raises its error."""
        if future.exception() is not None:
            self._tokens.put(future.exception())

    def _post(self, token: int) -> None:  # holding the executor's lock
        future: Future = Future()
        future.add_done_callback(self.on_error)
        self.executor.post_locked(self.proxy, token, future)

    # --- the lane thread -----------------------------------------------------------------

    def feed(self) -> None:
        if self.position >= self.proxy.target.max_context:
            raise EngineError(f"context overflow: ctx_size {self.proxy.target.max_context} tokens held")
        with self.executor.lock:
            if self._unfed is not None:
                token, self._unfed = self._unfed, None
                self._post(token)
            elif self._on_device:
                self._on_device = False
                self._post(PICKED)
            else:
                self._credit = True
        self.position += 1

    def read(self) -> int:
        while True:
            try:
                item = self._tokens.get(timeout=READ_POLL_S)
            except queue.Empty:
                if not self.executor.running:
                    raise EngineError("the engine executor has stopped") from None
                continue
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):
                handle, row = item
                return handle.ids()[row]
            return item

    def undo(self) -> None:
        """Take back the last feed: withdraw its decode if it has not run, else rewind one."""
        with self.executor.lock:
            self._credit, self._unfed, self._on_device = False, None, False
            ran = not self.executor.withdraw_locked(self.proxy)
        if ran:
            target = self.proxy.target
            self.executor.call(lambda: target.rewind(target.n_past - 1))
        self.position -= 1
