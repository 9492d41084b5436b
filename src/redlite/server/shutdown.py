"""Stopping the process on SIGINT/SIGTERM: never an abort, always exit status 0.

The rule (issue 12 §2), at every phase (loading, rendering, queue, prefill, decode, parking, a
disk write):

- the first signal stops gracefully: new requests are refused, waiting ones get 503
  ``server is shutting down``, the running one's client is answered at once with 503
  ``server is shutting down; the answer was cut off`` (an SSE error event and ``data: [DONE]``
  in a stream), the engine stops at its next prefill chunk or token, then the conversations
  (RAM-parked ones, and the live one when the engine is idle and consistent) are saved to
  ``--session-dir``;
- a second signal makes the exit immediate: no more waiting for the engine, no more files
  started; a file being written is finished (session files are written to a temporary name
  and renamed, so none is ever half-written under its real name);
- the process never dies of a signal nor aborts: the C++ runtime of torch calls
  ``std::terminate`` ("terminate called without an active exception", SIGABRT) when the
  interpreter finalizes while the engine thread is inside a torch operation, so when that
  thread has not ended the process leaves through ``os._exit(0)`` once logs are flushed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable

log = logging.getLogger("redlite")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_stop_signals() -> None:
    """The stop is over and the process is about to exit: ignore SIGINT and SIGTERM from now
    on. Interpreter finalization puts the default action back for signals that have a Python
    handler (not for ignored ones), so a signal arriving then would end the process by the
    signal instead of with its exit status."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Stopper:
    """Counts stop signals for the whole process life; ``on_first`` runs at the first one,
    ``on_second`` at any later one (both in the main thread, from the signal handler)."""

    def __init__(self) -> None:
        self.count = 0
        self.requested = threading.Event()
        self.immediate = threading.Event()
        self.on_first: list[Callable[[], None]] = []
        self.on_second: list[Callable[[], None]] = []
        self._writing = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def writing(self):
        """While inside, a second signal does not end the process (a file is being written);
        it ends right after, if one came."""
        with self._lock:
            self._writing += 1
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1
                last = self._writing == 0
            if last and self.immediate.is_set() and self.exit_now is not None:
                self.exit_now()

    #: set by the server once serving is over: ends the process (see :func:`leave`)
    exit_now: Callable[[], None] | None = None

    def end_now_unless_writing(self) -> None:
        """A second signal after serving: end the process now, or right after the file being
        written."""
        with self._lock:
            writing = self._writing
        if not writing and self.exit_now is not None:
            self.exit_now()

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on (uvicorn restores these handlers when its own
        signal capture ends, so the handling holds before, during and after serving)."""
        for sig in SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, sig: int, frame: object = None) -> None:
        self.count += 1
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        if self.count == 1:
            log.info("%s: stopping (a second signal stops at once)", name)
            self.requested.set()
            callbacks = self.on_first
        else:
            log.warning("%s again: stopping at once", name)
            self.immediate.set()
            callbacks = self.on_second
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a stop step that fails must not break the handler
                log.exception("stop step failed")

    def wait(self, alive: Callable[[float], bool], wait_s: float) -> bool:
        """Wait up to ``wait_s`` seconds for ``alive(timeout)`` (e.g. a thread join returning
        whether it ended) to report done, giving up at once on a second signal. True when
        done."""
        waited = 0.0
        while waited < wait_s and not self.immediate.is_set():
            step = min(0.1, wait_s - waited)
            if alive(step):
                return True
            waited += step
        return alive(0.0)


def leave(status: int, engine_thread_alive: bool) -> int:
    """Return ``status`` for a normal interpreter exit, or, when the engine thread is still
    inside an operation (finalizing the interpreter then aborts in torch's C++ runtime), flush
    the logs and standard streams and end the process now with ``os._exit(status)``. Logs
    ``stopped (exit status N)`` first: the log's last line says the server is gone."""
    log.info("stopped (exit status %d)", status)
    if not engine_thread_alive:
        return status
    log.info("the engine is still inside an operation: leaving without finalizing")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)
