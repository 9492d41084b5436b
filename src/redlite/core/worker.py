"""The engine worker: one thread, a FIFO of waiting jobs, generations run one at a time.

Rules (issue "FIFO request queue, overload, disconnects and shutdown"):
- jobs run in arrival order; at most ``max_queue`` wait behind the running one, one more is
  refused (:class:`QueueFull`, a 503 ``server busy``);
- a waiting job whose client has gone (``cancelled`` set) is skipped: the engine never runs it;
- a running job whose client has gone stops at the next token (the generator checks
  ``cancelled``);
- :meth:`EngineWorker.shutdown` fails the waiting jobs with :class:`ShuttingDown`, answers the
  running one's client at once (:data:`CUT_OFF`) and cancels it: the engine stops at its next
  prefill chunk or token, and what it holds stays consistent (saved at exit).

Results travel through ``Job.deliver``, a callback called on the worker thread (the HTTP layer
hands them over to its event loop).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from redlite.core.generation import Generator

from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.engine.base import TokenLogprob

log = logging.getLogger("redlite.worker")


class QueueFull(Exception):
    """More than ``max_queue`` jobs would wait."""


class ShuttingDown(Exception):
    """The server is stopping; the job was not (or no longer) run. The message, when given,
    is the one the client gets (default: ``server is shutting down``)."""


#: what the client of a generation stopped by a shutdown is told
CUT_OFF = "server is shutting down; the answer was cut off"


@dataclass
class Event:
    """What a job produces, in order: ``started`` once, ``output`` events (value: an
    :class:`redlite.core.chat.OutputEvent`; with logprobs on, a ``logprob`` event, value a
    TokenLogprob, comes before the output of its token), then ``done`` (value: a
    GenerationResult) or ``error`` (value: the exception). A request with ``n`` > 1 has one
    ``done`` per choice (``GenerationResult.index``); its last is ``index == n - 1``."""

    kind: str
    value: Any = None


@dataclass
class Job:
    """A request in the queue; ``deliver`` receives its :class:`Event` s on the worker thread."""

    request: GenerationRequest
    deliver: Callable[[Event], None]
    finished: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.request.cancelled.set()


def send(job: Job, event: Event) -> None:
    """Deliver ``event``; a receiver that has gone (the HTTP side stopped, its event loop is
    closed) is not an error of the engine: the job runs on (or stops) all the same."""
    try:
        job.deliver(event)
    except Exception as error:
        log.debug("%s: event %s not delivered: %s", job.request.request_id, event.kind, error)


def run_job(generator: Generator, job: Job, on_result: Callable[[GenerationResult], None] | None = None) -> None:
    """Run ``job`` on ``generator`` (on the caller's thread), delivering its events: ``started``
    (once the first choice's prompt work is launched: ``GenerationRequest.launched``, else
    before any other event), then what the generation yields, then ``done`` per choice or one
    ``error``. ``on_result`` (optional) is called with each choice's result before it is
    delivered."""
    pending = [True]

    def start() -> None:
        if pending[0]:
            pending[0] = False
            send(job, Event("started"))
    job.request.launched = start
    try:
        for item in generator.run(job.request):
            start()
            if isinstance(item, GenerationResult):
                if on_result is not None:
                    on_result(item)
                send(job, Event("done", item))
            elif isinstance(item, TokenLogprob):
                send(job, Event("logprob", item))
            else:
                send(job, Event("output", item))
        start()  # a job that yielded nothing (an EngineTask)
    except Exception as error:  # the request fails; the server keeps serving
        log.exception("%s failed", job.request.request_id)
        start()
        send(job, Event("error", error))


class EngineWorker:
    """Owns the :class:`Generator` and the only thread that touches the engine."""

    def __init__(self, generator: Generator, max_queue: int = 16) -> None:
        self.generator = generator
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._running: Job | None = None
        self._closing = False
        self.executed = 0  # jobs the engine actually ran (tests read it)
        self.skipped = 0   # waiting jobs dropped because their client had gone
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return sum(1 for job in self._waiting if not job.request.cancelled.is_set())

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def generators(self) -> list[Generator]:
        """The generator of each slot (one)."""
        return [self.generator]

    @property
    def running(self) -> list[bool]:
        """Per slot: whether a job runs in it."""
        return [self.busy]

    @property
    def closing(self) -> bool:
        """True once :meth:`shutdown` has begun."""
        return self._closing

    def submit(self, job: Job) -> None:
        """Queue ``job``. Raises QueueFull or ShuttingDown."""
        with self._lock:
            if self._closing:
                raise ShuttingDown()
            # Jobs whose clients have left do not count against the limit.
            in_system = sum(not j.request.cancelled.is_set() for j in self._waiting)
            in_system += self._running is not None
            if in_system >= 1 + self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self._lock.notify()

    def _skip(self, job: Job) -> None:
        self.skipped += 1
        log.info("%s skipped: client closed the connection while waiting", job.request.request_id)
        send(job, Event("error", ShuttingDown() if self._closing else ConnectionAbortedError()))
        job.finished.set()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closing:
                    self._lock.wait()
                if self._closing and not self._waiting:
                    return
                job = self._waiting.popleft()
                if job.request.cancelled.is_set():
                    self._skip(job)
                    continue
                self._running = job
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running = None
                    job.finished.set()
                    self._lock.notify_all()

    def _run(self, job: Job) -> None:
        self.executed += 1
        run_job(self.generator, job)

    def shutdown(self, wait_s: float = 4.0) -> None:
        """Refuse new jobs, fail waiting ones with ShuttingDown, stop the running one (its
        client is answered at once with :data:`CUT_OFF`; the engine stops at its next prefill
        chunk or token), and wait up to ``wait_s`` seconds for the worker thread to finish.
        Safe to call several times and from a signal handler."""
        with self._lock:
            first = not self._closing
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = self._running
            self._lock.notify_all()
        for job in waiting:
            send(job, Event("error", ShuttingDown()))
            job.finished.set()
        if running is not None and first:
            running.cancel()
            send(running, Event("error", ShuttingDown(CUT_OFF)))
        self.join(wait_s)

    def join(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` seconds for the worker thread to end; True when it has."""
        self._thread.join(max(0.0, wait_s))
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether the worker thread still runs (the engine may be inside an operation)."""
        return self._thread.is_alive()
