"""Several conversations at once (``--parallel N`` > 1): slots, lanes, admission, shutdown.

The same contract as :class:`redlite.core.worker.EngineWorker` (``submit``, ``shutdown``,
``join``, :class:`~redlite.core.worker.Job` events, :class:`~redlite.core.worker.QueueFull`,
:class:`~redlite.core.worker.ShuttingDown`), with N slots of one engine pool
(``Engine.new_slot``):

- each slot has a lane thread and a :class:`~redlite.core.generation.Generator` (its
  :class:`~redlite.core.sequence.Sequence`) whose engine is a
  :class:`~redlite.core.executor.SlotProxy`: every engine call runs on the one executor
  thread, decode steps of the running slots batched (:mod:`redlite.core.executor`);
- jobs are admitted in arrival order while a slot is idle; at most ``max_queue`` wait behind
  the N running ones, one more is :class:`QueueFull`; a waiting job whose client has gone is
  skipped; the slot is chosen by :func:`redlite.core.placement.place` (a slot API task
  runs in the slot it names, when that slot is idle: later jobs wait behind it); a job whose
  best prefix is in a slot whose request its client has left (still running to its next
  chunk or token) waits for that slot: a client's retry keeps what was prefilled;
- when placement names another idle slot to copy a prefix from, that slot is lent to the
  job's candidate step (:meth:`ExecutorParking.lend`): it takes no job until that step is
  over, so what is copied from it, on the executor thread, cannot change meanwhile (a job
  placed in a lent slot waits);
- the parking tiers are shared by all slots; each move of a conversation (the candidate step,
  a park, a restore) runs as one step on the executor thread (:class:`ExecutorParking`), so
  one slot moves conversations at a time and every engine call stays on that thread; they
  park whole conversations only (a tail entry's prefix would be one slot's live state);
- shutdown fails the waiting jobs, answers each running one's client at once
  (:data:`~redlite.core.worker.CUT_OFF`) and cancels it: each stops at its next prefill
  chunk or token with its state consistent.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time

from redlite.core.executor import EngineExecutor, SlotProxy
from redlite.core.executor_parking import ExecutorParking
from redlite.core.forks import trusted
from redlite.core.generation import Generator
from redlite.core.generation_request import EngineTask
from redlite.core.live_state import SlotPrefix
from redlite.core.placement import SlotView, place
from redlite.core.worker import CUT_OFF, Event, Job, QueueFull, ShuttingDown, run_job, send

log = logging.getLogger("redlite.scheduler")


class _Lane:
    def __init__(self, index: int, generator: Generator, proxy: SlotProxy) -> None:
        self.index, self.generator, self.proxy = index, generator, proxy
        self.job: Job | None = None
        self.thread: threading.Thread | None = None
        self.lent = 0  # candidate steps that may copy this idle slot's prefix now


class Scheduler:
    """Runs jobs on ``len(generators)`` slots (see module docstring). ``generators[i]``'s
    engine is slot i's :class:`SlotProxy` on ``executor``; their ``parking`` is the shared
    tiers behind an :class:`ExecutorParking` (use :func:`build_scheduler`)."""

    def __init__(self, generators: list[Generator], executor: EngineExecutor,
                 max_queue: int = 16) -> None:
        self.executor = executor
        self.max_queue = max_queue
        self.lanes = [_Lane(i, g, g.engine) for i, g in enumerate(generators)]
        self._waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._closing = False
        self.executed = 0
        self.skipped = 0
        for lane in self.lanes:
            lane.thread = threading.Thread(target=self._lane_loop, args=(lane,),
                                           name=f"engine-slot-{lane.index}", daemon=True)
            lane.thread.start()

    # --- what the server reads ---------------------------------------------------------------

    @property
    def generator(self) -> Generator:
        """Slot 0's generator (its ``parking`` is the shared tiers)."""
        return self.lanes[0].generator

    @property
    def generators(self) -> list[Generator]:
        return [lane.generator for lane in self.lanes]

    @property
    def running(self) -> list[bool]:
        """Per slot: whether a job runs in it."""
        return [lane.job is not None for lane in self.lanes]

    @property
    def closing(self) -> bool:
        """True once :meth:`shutdown` has begun."""
        return self._closing

    @property
    def busy(self) -> bool:
        return any(self.running)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return sum(1 for job in self._waiting if not job.request.cancelled.is_set())

    # --- admission ---------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``. Raises QueueFull or ShuttingDown."""
        with self._lock:
            if self._closing:
                raise ShuttingDown()
            in_system = sum(not j.request.cancelled.is_set() for j in self._waiting)
            in_system += sum(self.running)
            if in_system >= len(self.lanes) + self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self._dispatch()

    def _dispatch(self) -> None:
        """Admit waiting jobs to idle slots, in arrival order (holding the lock)."""
        while self._waiting:
            job = self._waiting[0]
            if job.request.cancelled.is_set():
                self._waiting.popleft()
                self.skipped += 1
                log.info("%s skipped: client closed the connection while waiting",
                         job.request.request_id)
                send(job, Event("error", ConnectionAbortedError()))
                job.finished.set()
                continue
            idle = [lane for lane in self.lanes if lane.job is None]
            request = job.request
            if isinstance(request, EngineTask):
                idle = [lane for lane in idle if lane.index == request.slot]
            if not idle:
                return
            if self._draining_is_best(idle, request):  # a retry of a request its client left
                return
            placement = place([_view(lane) for lane in idle], request.prompt_ids, request.session_key)
            chosen = self.lanes[placement.slot]
            if chosen.lent:  # its prefix is being copied: the job waits for it
                return
            self._waiting.popleft()
            if placement.common is not None and not isinstance(request, EngineTask):
                chosen.generator.know_common(request.prompt_ids, placement.common)  # not compared again
            chosen.job = job
            self.executed += 1
            log.info("%s placed in slot %d: %s", request.request_id, chosen.index, placement.reason)
            parking, source = chosen.generator.parking, placement.source
            if source is not None and isinstance(parking, ExecutorParking) and chosen.generator.settings.reuse:
                source = self.lanes[source]
                source.lent += 1
                parking.lend(SlotPrefix(source.generator, source.proxy.target, source.index),
                             functools.partial(self._returned, source))
            self._lock.notify_all()

    def _draining_is_best(self, idle: list[_Lane], request) -> bool:
        """Whether a slot whose request was cancelled (its client left) but still runs to its
        next prefill chunk or token holds the best usable prefix for ``request``: a client's
        retry then waits for that slot, which keeps what was prefilled, instead of starting
        over in another (as ``--parallel 1`` would reuse it)."""
        if isinstance(request, EngineTask):
            return False
        draining = [lane for lane in self.lanes
                    if lane.job is not None and lane.job.request.cancelled.is_set() and lane.generator.held_ids]
        if not draining:
            return False
        views = [_view(lane) for lane in idle] + [_view(lane, settling=True) for lane in draining]
        best = self.lanes[place(views, request.prompt_ids, request.session_key).slot]
        return best.job is not None

    def _returned(self, lane: _Lane) -> None:
        """A candidate step that could copy ``lane``'s prefix is over: it may take jobs again."""
        with self._lock:
            lane.lent -= 1
            if not self._closing:
                self._dispatch()
            self._lock.notify_all()

    # --- the lanes ---------------------------------------------------------------------------

    def _lane_loop(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                while lane.job is None and not self._closing:
                    self._lock.wait()
                job = lane.job
                if job is None:
                    return
            try:
                run_job(lane.generator, job, on_result=lambda _result: lane.proxy.rest())
            finally:
                if isinstance(lane.generator.parking, ExecutorParking):
                    lane.generator.parking.end_offer()  # a job that never reached its candidate step
                lane.proxy.rest()
                lane.generator.sequence.touch()
                with self._lock:
                    lane.job = None
                    job.finished.set()
                    if not self._closing:
                        self._dispatch()
                    self._lock.notify_all()

    # --- stop --------------------------------------------------------------------------------

    def shutdown(self, wait_s: float = 4.0) -> None:
        """Refuse new jobs, fail waiting ones with ShuttingDown, stop the running ones (each
        client is answered at once with :data:`CUT_OFF`) and wait up to ``wait_s`` seconds
        for the slots and the executor to finish. Safe to call several times."""
        with self._lock:
            first = not self._closing
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = [lane.job for lane in self.lanes if lane.job is not None]
            self._lock.notify_all()
        for job in waiting:
            send(job, Event("error", ShuttingDown()))
            job.finished.set()
        if first:
            for job in running:
                job.cancel()
                send(job, Event("error", ShuttingDown(CUT_OFF)))
        self.join(wait_s)

    def join(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` seconds for the slots' threads, then the executor, to end;
        True when all have."""
        deadline = time.monotonic() + max(0.0, wait_s)
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
        if any(lane.thread.is_alive() for lane in self.lanes):
            return False
        return self.executor.close(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        """Whether a slot's thread or the executor still runs."""
        return any(lane.thread.is_alive() for lane in self.lanes) or self.executor._thread.is_alive()


def _view(lane: _Lane, settling: bool = False) -> SlotView:
    """``lane`` as placement sees it; ``settling``: its cancelled request is still running and
    its held ids (a copy: they may grow by the chunk in flight) count as trusted, as they will
    be once it stops."""
    gen = lane.generator
    held = list(gen.held_ids) if settling else gen.held_ids
    return SlotView(lane.index, held, settling or trusted(gen), gen.engine.can_rewind,
                    list(gen.checkpoints.positions), gen.session_key, gen.sequence.last_used,
                    gen.sequence.answer_start)


def build_scheduler(generator: Generator, parallel: int, max_queue: int = 16,
                    decode_ahead: bool | None = None, warm: bool = False) -> Scheduler | None:
    """A :class:`Scheduler` of ``parallel`` slots: ``generator``'s engine and
    ``parallel - 1`` new slots of it (``Engine.new_slot``), generators with its tokenizer,
    settings and parking (whole entries only, run on the executor). None when the engine cannot
    make slots (the caller runs one sequence at a time). ``decode_ahead``: see
    :mod:`redlite.core.executor_stream` (``--decode-ahead``); None: on where the engine computes on
    an accelerator, off on CPU, where the lanes' scans and the kernels share the cores (it
    measured slower there: ``bench/results/concurrent-*-vm-epyc*``). ``warm``: warm the slots up
    on a GPU (:func:`~redlite.engine.warmup.warm_up_slots`, the start-up warm-up's part for
    slots)."""
    from redlite.engine.base import EngineError

    pool = generator.engine
    try:
        engines = [pool] + [pool.new_slot() for _ in range(parallel - 1)]
    except EngineError as error:
        log.warning("--parallel %d: %s; serving one sequence at a time", parallel, error)
        return None
    if warm:
        from redlite.engine.warmup import warm_up_slots

        warm_up_slots(engines)
    if decode_ahead is None:
        decode_ahead = getattr(getattr(pool, "device", None), "type", "cpu") != "cpu"
    executor = EngineExecutor(pool, decode_ahead=decode_ahead)
    parking = generator.parking
    if parking is not None:
        parking.tails = False
    generators = []
    for engine in engines:
        gen = Generator(SlotProxy(engine, executor), generator.tokenizer, generator.settings)
        gen.parking = ExecutorParking(parking, executor) if parking is not None else None
        generators.append(gen)
    log.info("%d sequence slots (one batched decode, decode ahead %s)", parallel, "on" if decode_ahead else "off")
    return Scheduler(generators, executor, max_queue)
