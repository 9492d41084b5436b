"""Progress of a slow one-time job (the first start's GGUF conversion), shown where it was
started from: a ``tqdm`` bar on ``stream`` (default stderr) when that is a terminal, else plain
INFO lines on the ``redlite.loading`` logger, one per stage and at most one per ``every_s``
seconds of counting (log files and pipes get no carriage-return bar).

A job is a sequence of stages (:meth:`Progress.stage`); counted units (:meth:`Progress.advance`)
fill the bar once :meth:`Progress.expect` has set the total. Stages that cannot count (a
library call) still show the elapsed time: the bar is redrawn every ``refresh_s`` seconds.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from typing import Any, TextIO

logger = logging.getLogger("redlite.loading")


class Progress:
    """See module docstring. ``title``: what the job is (the bar's prefix and the lines' start).
    ``show``: False counts without showing anything. Use as a context manager, or call
    :meth:`close`."""

    def __init__(self, title: str, stream: TextIO | None = None, every_s: float = 5.0,
                 refresh_s: float = 0.5, clock=time.monotonic, show: bool = True) -> None:
        self.title, self.every_s, self._clock, self.show = title, every_s, clock, show
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = show and (bool(isatty()) if callable(isatty) else False)
        self.done, self.total, self.name = 0, None, ""
        self._logged = clock()
        self._bar: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.tty:
            from tqdm import tqdm

            # the terminal's width, 80 where it reports none (tqdm would draw nothing)
            columns = shutil.get_terminal_size((80, 24)).columns
            self._bar = tqdm(total=None, desc=title, file=self.stream, unit="step",
                             ncols=columns, leave=True, mininterval=0.1)
            self._ticker = threading.Thread(target=self._tick, args=(refresh_s,), daemon=True,
                                            name="redlite-progress")
            self._ticker.start()

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            self._bar.refresh()

    def expect(self, total: int) -> None:
        """The job's number of units (the bar's 100 %)."""
        self.total = int(total)
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def stage(self, name: str) -> None:
        """A new stage begins (its name shown beside the bar, or logged)."""
        self.name = name
        if self._bar is not None:
            self._bar.set_description_str(f"{self.title}: {name}")
        elif self.show:
            logger.info("%s: %s%s", self.title, name, self._count())
            self._logged = self._clock()

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.show and self._clock() - self._logged >= self.every_s:
            logger.info("%s: %s%s", self.title, self.name, self._count())
            self._logged = self._clock()

    def _count(self) -> str:
        if self.total is None:
            return ""
        return f" ({self.done}/{self.total}, {100 * self.done // max(1, self.total)}%)"

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._bar is not None:
            self._bar.set_description_str(self.title)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
