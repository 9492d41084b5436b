"""The stop rules of redlite.server.shutdown.Stopper, in process (the signal tests drive a real
server; these pin the ordering: a second signal never ends the process inside a file write)."""

import signal
import threading
import time

from redlite.server.shutdown import Stopper


def test_first_and_second_signal_callbacks():
    stopper, calls = Stopper(), []
    stopper.on_first.append(lambda: calls.append("first"))
    stopper.on_second.append(lambda: calls.append("second"))
    stopper.handle(signal.SIGTERM)
    assert stopper.requested.is_set() and not stopper.immediate.is_set()
    stopper.handle(signal.SIGINT)
    stopper.handle(signal.SIGINT)
    assert calls == ["first", "second", "second"] and stopper.immediate.is_set()


def test_second_signal_during_a_write_exits_only_after_it():
    stopper, events = Stopper(), []
    stopper.exit_now = lambda: events.append("exit")
    stopper.on_second.append(stopper.end_now_unless_writing)
    stopper.handle(signal.SIGINT)
    with stopper.writing():
        stopper.handle(signal.SIGINT)
        events.append("write finished")
    assert events == ["write finished", "exit"]


def test_second_signal_outside_a_write_exits_at_once():
    stopper, events = Stopper(), []
    stopper.exit_now = lambda: events.append("exit")
    stopper.on_second.append(stopper.end_now_unless_writing)
    stopper.handle(signal.SIGINT)
    stopper.handle(signal.SIGINT)
    assert events == ["exit"]


def test_wait_gives_up_on_a_second_signal():
    stopper = Stopper()
    never = threading.Event()
    threading.Timer(0.2, lambda: stopper.handle(signal.SIGINT) or stopper.handle(signal.SIGINT)).start()
    started = time.monotonic()
    assert stopper.wait(lambda timeout: never.wait(timeout), 10.0) is False
    assert time.monotonic() - started < 2.0
