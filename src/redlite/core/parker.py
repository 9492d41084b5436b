"""Parking: putting a conversation's state into the tiers (the pool in device or host memory,
then disk) and, at stop, everything to disk.

- :meth:`Parker.park_live` copies what the live conversation would lose (only the tail past the
  prefix that stays live, :mod:`redlite.core.forks`), on the device while ``--park-device-mib``
  has room (engines with device memory), else in host memory; a state that neither the pool
  would admit nor the disk tier would take is dropped without being copied.
- :meth:`Parker.park` stores an entry in the pool when its eviction plan
  (:func:`~redlite.core.eviction.plan_eviction`) admits it, spilling what it evicts to disk;
  otherwise it goes straight to disk (when big enough). Entries it supersedes (it extends them;
  engines that can rewind) leave the pool only once it is admitted.
- Files stand alone: a tail entry goes to disk whole (:meth:`Lineage.whole`).

Every step logs one line (what was parked, where, why something was dropped). Used from the
engine worker thread only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from redlite.core.forks import Lineage, trusted
from redlite.core.live_state import capture, capture_tail
from redlite.core.eviction import EntryStats, EvictionPlan, plan_eviction
from redlite.core.parking import ID_BYTES_PER_TOKEN, LIVE, ParkedEntry, ParkingPool
from redlite.core.sessions import SessionStore

if TYPE_CHECKING:
    from redlite.core.generation import Generator

log = logging.getLogger("redlite.parking")


class Parker:
    """The parking tiers of one generator: ``pool`` (device and host memory, may be None),
    ``sessions`` (disk, may be None) and the ``lineage`` of the pool's tail entries.

    on_timing: None, or ``on_timing(kind, tier, seconds)`` called on the worker thread after
    each successful ``restore`` (tier ``device``, ``ram`` or ``disk``: where the entry was),
    ``park`` (tier ``device`` or ``ram``: copy + admission) and ``save`` (tier ``disk``: a
    session file written or found identical). timer: the monotonic clock of those seconds."""

    def __init__(self, pool: ParkingPool | None, sessions: SessionStore | None,
                 clock=time.time, timer=time.perf_counter) -> None:
        self.pool, self.sessions, self._clock, self._timer = pool, sessions, clock, timer
        self.on_timing = None
        self.lineage = Lineage(pool, spill=lambda entry, reason: self._spill(entry, reason, frozenset(),
                                                                             True))
        self._gen = None  # the generator of the running request (for spills of tail entries)
        # False with several slots: park whole entries only (a tail's prefix would be the
        # live state of one slot among several)
        self.tails = True
        self.replay = None  # exact replay's turns (ReplayStore; Conversations.attach_replay)
        self._pending = None  # a deferred park_live's bookkeeping: (gen, park() arguments)
        self.request_id: str | None = None  # the running request's (its parking lines start with it)

    def _who(self) -> str:
        """The running request's id and a space, the start of its parking lines ('' outside one)."""
        return f"{self.request_id} " if self.request_id else ""

    def _with_turns(self, entry: ParkedEntry) -> ParkedEntry:
        """``entry`` with the store's turns its held ids hold added to its own."""
        if self.replay is not None:
            found = self.replay.turns_in(entry.held_ids)
            keys = {t.key for t in found}
            entry.replay = [t for t in entry.replay if t.key not in keys] + found
        return entry

    def _timed(self, kind: str, tier: str, seconds: float) -> None:
        if self.on_timing is not None:
            try:
                self.on_timing(kind, tier, seconds)
            except Exception:  # noqa: BLE001 - counting never fails a conversation move
                log.exception("timing listener failed")

    def before_cut(self, gen: "Generator", keep: int) -> None:
        """Called before the live state is cut to ``keep`` tokens or replaced (0): the one
        entry point of :meth:`Lineage.release_live` for the generator and
        :mod:`redlite.core.live_state`."""
        self._gen = gen
        self.lineage.release_live(gen, keep)

    def settle(self, gen: "Generator") -> None:
        """Called once ``gen``'s first token is out and held (else before its result, or when
        it stops early: :meth:`Generator._run_choice`): the host work left from its candidate
        step, done while a GPU computes the next token instead of before the first one. The
        deferred bookkeeping of a parked tail (``park_live(defer=True)``: admission,
        evictions, the pool's index, the log line), then the prefix index's hashes
        of the held ids' full blocks (kept by the sequence; else the next request's candidate
        step would hash a new conversation whole). Never raises (logged)."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None and pending[0] is gen:
                entry, protected, can_rewind, copy_s, hashes, superseded = pending[1]
                self.park(self._with_turns(entry), protected, can_rewind, self._timer() - copy_s,
                          hashes, superseded)
            for tier in (self.pool, self.sessions):
                if tier is not None:
                    gen.sequence.held_hashes(tier.block)
        except Exception:  # noqa: BLE001 - the next candidate step sees the pool as it is
            log.exception("parking bookkeeping failed")

    def park_live(self, gen: "Generator", protected: frozenset, keep: int = 0,
                  defer: bool = False) -> None:
        """Park what the live conversation holds past ``keep`` tokens (never raises; logged):
        the whole state when ``keep`` is 0, else a tail entry on the live prefix (see
        :mod:`redlite.core.forks`). On the device while ``--park-device-mib`` has room for it
        (engines with device memory), else in host memory. The size is checked first
        (``Engine.range_nbytes``): a state that neither the pool would admit nor the disk tier
        would take is dropped without being copied. ``defer``: for a tail entry that no other
        entry depends on past ``keep``, only the copy is made now; the rest waits for
        :meth:`settle` (the entry is not in the pool until then)."""
        started = self._timer()
        self._gen = gen
        n = len(gen.held_ids)
        if keep >= n:
            return
        if not self.tails:
            keep = 0
        engine = gen.engine
        try:
            state = engine.range_nbytes(keep) if keep else engine.state_nbytes()
            estimate = (state + sum(c.nbytes for c in gen.checkpoints.items() if c.position > keep)
                        + ID_BYTES_PER_TOKEN * n)
        except Exception as error:
            log.warning("%spark failed %d tok reason=%s: %s", self._who(), n, type(error).__name__, error)
            return
        pool = self.pool
        on_device = bool(pool is not None and engine.device_resident
                         and pool.device_nbytes + estimate <= pool.device_budget_bytes)
        parent = LIVE if keep else None
        stats = EntryStats("live", estimate, n, self._clock(), keep, parent, on_device)
        to_disk = self.sessions is not None and self.sessions.eligible(n)
        hashes = gen.sequence.held_hashes(pool.block) if pool is not None else None
        superseded = self._superseded(gen.held_ids, protected, engine.can_rewind, hashes, live=True)
        if not to_disk and (pool is None or not self._admission(stats, superseded, protected).admit):
            log.info("%sevicted %d tok (%d bytes) from live reason=no-room -> dropped (not copied)",
                     self._who(), n - keep, estimate)
            return
        try:
            key = self.pool.new_key() if self.pool is not None else f"live-{id(gen)}-{started}"
            if keep == 0 and not on_device:
                entry = capture(gen, key, self._clock())
            else:
                try:
                    entry = capture_tail(gen, key, self._clock(), keep, on_device)
                except Exception as error:  # noqa: BLE001 - device memory short: host memory
                    if not on_device:
                        raise
                    log.warning("%spark on device failed (%s: %s); host memory instead",
                                self._who(), type(error).__name__, error)
                    entry = capture_tail(gen, key, self._clock(), keep, False)
        except Exception as error:
            log.warning("%spark failed %d tok reason=%s: %s", self._who(), n, type(error).__name__, error)
            return
        if defer and entry.is_tail and self.tails and pool is not None and \
                not any(e.base > keep for e in pool.children(LIVE)):
            # the cut that follows releases nothing, so the pool may learn of the entry later
            self._pending = (gen, (entry, protected, engine.can_rewind, self._timer() - started,
                                   hashes, superseded))
            return
        self.park(self._with_turns(entry), protected, engine.can_rewind, started, hashes, superseded)

    def _superseded(self, held_ids: list[int], protected: frozenset, can_rewind: bool,
                    hashes: list[bytes] | None, live: bool = False) -> list:
        """Pool entries a conversation holding ``held_ids`` makes redundant (it extends them);
        live: ``held_ids`` are the live state's (see :meth:`ParkingPool.prefixes_of`)."""
        if self.pool is None or not can_rewind:
            return []
        return [key for key in self.pool.prefixes_of(held_ids, hashes, live) if key not in protected]

    def _admission(self, stats: EntryStats, superseded: list, protected: frozenset) -> EvictionPlan:
        """The pool's eviction plan for an entry, counting the superseded entries as gone."""
        gone = set(superseded)
        current = [self.pool.stats(e) for e in self.pool.entries() if e.key not in gone]
        return plan_eviction(current, stats, self.pool.budget_bytes, self.pool.max_entries, protected,
                             self.pool.device_budget_bytes)

    def park(self, entry: ParkedEntry, protected: frozenset, can_rewind: bool,
             started: float | None = None, hashes: list[bytes] | None = None,
             superseded: list | None = None) -> None:
        """Put ``entry`` into the pool when its eviction plan admits it, spilling what it
        evicts to disk; otherwise straight to disk (when big enough). Entries it supersedes
        (it extends them; engines that can rewind) leave the pool only once it is admitted.
        hashes: the pool's hashes of its held ids (computed here when not given); superseded:
        the entries it supersedes (:meth:`_superseded`, found here when not given)."""
        n = len(entry.held_ids)
        if self.pool is None:
            self._spill(entry, "no-ram-pool", protected, can_rewind, source="live")
            return
        hashes = self.pool.hashes(entry.held_ids) if hashes is None else hashes
        if superseded is None:
            superseded = self._superseded(entry.held_ids, protected, can_rewind, hashes)
        plan = self._admission(self.pool.stats(entry), superseded, protected)
        if not plan.admit:
            self._spill(entry, "no-room", protected, can_rewind, source="live")
            return
        for key in superseded:
            old = self.pool.pop(key)
            log.info("%sevicted %d tok from %s reason=superseded", self._who(), len(old.held_ids), old.tier)
        for key in plan.evict:
            self._spill(self.pool.pop(key), "value", protected, can_rewind)
        self.pool.add(entry, hashes)
        if self._gen is not None and (entry.parent == LIVE or entry.base == 0):
            self.lineage.release_live(self._gen, entry.base, heir=entry)  # it copies the live state
        seconds = self._timer() - started if started is not None else 0.0
        if started is not None:
            self._timed("park", entry.tier, seconds)
        ms = seconds * 1000.0
        log.info("%sparked %d tok (%d bytes) in %.1f ms: tokens [%d, %d) tier=%s as %s (%s)%s; pool "
                 "%d entries, %d bytes host, %d bytes device", self._who(), n - entry.base, entry.nbytes, ms,
                 entry.base, n, entry.tier, entry.key,
                 f"tail on the live prefix [0, {entry.base})" if entry.is_tail else "whole",
                 f" session={entry.session}" if entry.session else "", len(self.pool),
                 self.pool.host_nbytes, self.pool.device_nbytes)

    def _spill(self, entry: ParkedEntry, reason: str, protected: frozenset, can_rewind: bool,
               source: str | None = None) -> None:
        """An entry leaving the pool (or, ``source`` ``live``, not admitted): to disk when big
        enough, saved whole (a tail entry joined with its chain's prefix), else dropped."""
        n = len(entry.held_ids)
        to_disk = self.sessions is not None and self.sessions.eligible(n)
        log.info("%sevicted %d tok (%d bytes) from %s reason=%s -> %s", self._who(), n - entry.base, entry.nbytes,
                 source or entry.tier, reason, "disk" if to_disk else "dropped")
        if to_disk:
            try:
                whole = self.lineage.whole(self._gen, entry)
            except Exception as error:  # noqa: BLE001 - its prefix is gone: not saved
                log.warning("save skipped %d tok reason=%s: %s", n, type(error).__name__, error)
                return
            started = self._timer()
            if self.sessions.save(self._with_turns(whole), supersede=can_rewind,
                                  protected=protected) is not None:
                self._timed("save", "disk", self._timer() - started)

    # --- stop --------------------------------------------------------------------------------

    def save_all(self, gen: "Generator", live: bool = True, should_stop=None,
                 guard=contextlib.nullcontext, residents=()) -> int:
        """Stop: write the live conversation (when ``live``: the engine is idle; and only when
        consistent), those of the other slots' generators ``residents`` (likewise) and every
        pool entry big enough to disk, newest first. ``should_stop()``
        (optional) is asked before each file: True ends the saving (a second signal); each
        file is written inside ``guard()`` (a context manager: the process does not end
        while a file is being written). Returns the files written or found identical."""
        self.request_id = None  # no request runs now
        if self.sessions is None:
            return 0
        entries: list[ParkedEntry] = []
        for slot, held in enumerate([gen, *residents] if live else []):
            if trusted(held) and self.sessions.eligible(len(held.held_ids)):
                try:
                    entries.append(capture(held, f"live-{slot}" if slot else "live", self._clock()))
                except Exception as error:
                    log.warning("save failed %d tok reason=%s: %s", len(held.held_ids),
                                type(error).__name__, error)
        if self.pool is not None:
            entries += sorted(self.pool.entries(), key=lambda e: -e.last_used)
        saved = 0
        for done, entry in enumerate(entries):
            if should_stop is not None and should_stop():
                log.info("stop: %d conversations not saved (stopping at once)", len(entries) - done)
                break
            if entry.is_tail or entry.on_device:  # saved whole: joined with its prefix
                try:
                    if not live and self.lineage.chain(entry)[0].parent == LIVE:
                        raise RuntimeError("its prefix is the live state, which is busy")
                    entry = self.lineage.whole(gen, entry)
                except Exception as error:  # noqa: BLE001 - logged, the others are saved
                    log.warning("save skipped %d tok reason=%s: %s", len(entry.held_ids),
                                type(error).__name__, error)
                    continue
            with guard():
                started = self._timer()
                if self.sessions.save(self._with_turns(entry), supersede=gen.engine.can_rewind) is not None:
                    self._timed("save", "disk", self._timer() - started)
                    saved += 1
        return saved
