"""Switching conversations: the candidate-selection step before a request's reuse plan.

:meth:`Conversations.select` runs on the engine worker thread at the start of every request
(see :meth:`redlite.core.generation.Generator.run`):

1. candidates: the live state, and the parked entries (RAM pool, then disk) that the prefix
   indexes name for the prompt, each with its usable prefix (:func:`usable_prefix`);
2. the best (:func:`choose_candidate`) is fetched: from RAM (popped when the prompt extends
   it, else left parked and protected from eviction during this request), or read and
   verified from disk (a refused file drops out and the choice is made again);
3. the live state is parked unless nothing of it would be lost (the prompt extends it, or the
   chosen state contains it): only what the switch discards, ``[keep, held)`` (a tail entry,
   :mod:`redlite.core.forks`; the whole state when nothing of it is kept), on the device while
   ``--park-device-mib`` allows, else in host memory; into the pool if the eviction plan
   admits it, else (and for each entry the pool evicts) to disk when big enough (saved whole);
4. the chosen entry is installed: engine state, held ids and checkpoints replaced together
   (a tail entry: its chain's ranges written after the prefix they share); a failed restore
   resets the engine and the request runs cold.

The Generator then plans reuse against the (possibly new) held state as usual. Nothing here
raises into the request: failures are logged and end in a consistent (possibly empty) state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Hashable

from redlite.core.forks import Lineage, parked_checkpoint, trusted
from redlite.core.parking import (ID_BYTES_PER_TOKEN, LIVE, Candidate, EntryStats, EvictionPlan,
                                  ParkedCheckpoint, ParkedEntry, ParkingPool, choose_candidate,
                                  plan_eviction, tail_usable, tensor_nbytes, usable_prefix)
from redlite.core.reuse import common_prefix_length
from redlite.core.sessions import SessionStore

if TYPE_CHECKING:
    from redlite.core.generation import Generator

log = logging.getLogger("redlite.parking")


def capture(gen: "Generator", key: Hashable, now: float) -> ParkedEntry:
    """Copy the live conversation (engine snapshot, held ids, checkpoints) to host memory.
    Raises whatever ``engine.snapshot`` raises."""
    engine = gen.engine
    snapshot = engine.snapshot()
    checkpoints = []
    for c in gen.checkpoints.items():
        host = engine.checkpoint_to_tensors(c)
        if host is None:
            checkpoints.append(ParkedCheckpoint(c.position, c.turn_boundary, c.nbytes, obj=c))
        else:
            tensors, meta = host
            checkpoints.append(ParkedCheckpoint(c.position, c.turn_boundary,
                                                tensor_nbytes(tensors), tensors, meta))
    return ParkedEntry(key, list(gen.held_ids), snapshot, checkpoints, now, now,
                       session=getattr(gen, "session_key", None), hits=gen.hits)


def capture_tail(gen: "Generator", key: Hashable, now: float, keep: int,
                 on_device: bool) -> ParkedEntry:
    """Copy what the live conversation holds past ``keep`` (``Engine.snapshot_range``; its
    checkpoints past ``keep``): a tail entry on the live prefix when ``keep`` > 0, a whole one
    otherwise; in device memory when ``on_device``. Raises what the engine raises."""
    engine = gen.engine
    snapshot = engine.snapshot_range(keep, on_device=on_device)
    checkpoints = [parked_checkpoint(engine, c, on_device) for c in gen.checkpoints.items()
                   if c.position > keep]
    return ParkedEntry(key, list(gen.held_ids), snapshot, checkpoints, now, now,
                       session=getattr(gen, "session_key", None), hits=gen.hits, base=keep,
                       parent=LIVE if keep > 0 else None, on_device=on_device)


def install(gen: "Generator", entry: ParkedEntry) -> bool:
    """Make ``entry`` the live conversation. On any failure the engine is reset (held ids and
    checkpoints emptied) and False returned: held ids and engine state always agree."""
    engine = gen.engine
    gen.failed = True
    try:
        if entry.fill is not None:  # a file: straight into the engine's memory where it can
            entry.fill(engine)
        engine.restore(entry.snapshot)
        checkpoints = [c.obj if c.obj is not None else
                       engine.checkpoint_from_tensors(c.position, c.tensors, c.meta, c.turn_boundary)
                       for c in entry.checkpoints]
        if engine.n_past != len(entry.held_ids):
            raise RuntimeError(f"engine holds {engine.n_past} tokens after restore, "
                               f"expected {len(entry.held_ids)}")
        if entry.verify is not None:  # a file read while it was copied in: checksum now
            entry.verify()
        gen.held_ids = list(entry.held_ids)
        gen.checkpoints.clear()
        for checkpoint in checkpoints:
            gen.checkpoints.add(checkpoint)
        gen.hits, gen.session_key = entry.hits, entry.session
        gen.failed = False
        return True
    except Exception as error:  # a failed restore never fails the request: run cold
        log.warning("restore failed %d tok reason=%s: %s; running cold", len(entry.held_ids),
                    type(error).__name__, error)
        reset(gen)
        return False


def reset(gen: "Generator") -> int:
    """Drop the live conversation; returns the tokens it held (parked entries depending on it
    are made whole first, or dropped when it is not trusted). If the engine cannot even
    reset, the generator stays marked failed (its next plan resets)."""
    held = len(gen.held_ids)
    if gen.parking is not None:
        gen.parking.before_cut(gen, 0)
    gen.failed = True
    gen.engine.reset()
    gen.held_ids = []
    gen.checkpoints.clear()
    gen.hits, gen.session_key = 0, None
    gen.failed = False
    return held


class Conversations:
    """The parking tiers of one generator: ``pool`` (RAM, may be None) and ``sessions``
    (disk, may be None). Used from the engine worker thread only.

    on_timing: None, or ``on_timing(kind, tier, seconds)`` called on the worker thread after
    each successful ``restore`` (tier ``device``, ``ram`` or ``disk``: where the entry was),
    ``park`` (tier ``device`` or ``ram``: capture + admission) and ``save`` (tier ``disk``: a
    session file written). timer: the monotonic clock of those seconds."""

    def __init__(self, pool: ParkingPool | None, sessions: SessionStore | None,
                 clock=time.time, timer=time.perf_counter) -> None:
        self.pool, self.sessions, self._clock, self._timer = pool, sessions, clock, timer
        self.on_timing = None
        self.lineage = Lineage(pool, spill=lambda entry, reason: self._spill(entry, reason, frozenset(),
                                                                             True))
        self._gen = None  # the generator of the running selection (for spills of tail entries)
        self._session: str | None = None  # the current request's session key

    # --- the candidate-selection step --------------------------------------------------------

    def select(self, gen: "Generator", prompt: list[int], request_id: str = "req",
               session: str | None = None) -> None:
        """Bring the best candidate for ``prompt`` into the engine (see module docstring).
        session: the request's session key; that session's parked RAM entry is the first
        candidate (it wins ties)."""
        self._session = session
        try:
            self._select(gen, prompt, request_id)
        except Exception:  # never fails the request; the generator's plan sees the state
            log.exception("%s parking failed; continuing with the live state", request_id)
            if gen.failed:
                try:
                    reset(gen)
                except Exception:
                    pass

    def before_cut(self, gen: "Generator", keep: int) -> None:
        """Called before the live state is cut to ``keep`` tokens or replaced (0): the one
        entry point of :meth:`Lineage.release_live` for the generator and :func:`reset`."""
        self._gen = gen
        self.lineage.release_live(gen, keep)

    def _select(self, gen: "Generator", prompt: list[int], request_id: str) -> None:
        self._gen = gen
        if not trusted(gen):  # the live state is not what tail entries were taken against
            self.lineage.release_live(gen, 0)
        held = gen.held_ids
        live_common = 0 if gen.failed else common_prefix_length(held, prompt)
        live_usable = usable_prefix(len(held), live_common, len(prompt), gen.engine.can_rewind,
                                    gen.checkpoints.positions)
        while True:  # again only after a refused file (it has left the index)
            choice = choose_candidate(self._candidates(prompt, live_usable, gen.engine))
            if choice is None or choice.key == LIVE:
                kept = choice.usable if choice is not None else 0
                if self._live_would_lose(gen, live_common, kept):
                    self.park_live(gen, frozenset(), keep=kept)
                return
            started = self._timer()
            entry = self._fetch(choice)
            if entry is None:
                continue
            links = self.lineage.chain(entry) if entry.is_tail else [entry]
            keep = links[0].base if links[0].parent == LIVE else 0
            if self._live_would_lose(gen, live_common, choice.usable):
                self.park_live(gen, frozenset(e.key for e in links), keep=keep)
            popped = choice.tier == "ram" and choice.key not in self.pool
            installed = self._install(gen, entry, keep)
            if popped:  # its dependants now build on the live state, or lost their prefix
                self.lineage.adopt(choice.key, installed)
            if installed:
                seconds = self._timer() - started
                self._timed("restore", "device" if entry.on_device else choice.tier, seconds)
                tail = f" tail [{entry.base}, {len(entry.held_ids)})" if entry.is_tail else ""
                log.info("%s restored from %s %d tok in %.1f ms (usable %d)%s%s", request_id,
                         choice.tier, len(entry.held_ids), seconds * 1000.0, choice.usable, tail,
                         f" session={entry.session}" if entry.session else "")
            elif choice.tier == "disk" and choice.key not in self.sessions:
                self._select(gen, prompt, request_id)  # a refused file left the index: again
            return

    def _install(self, gen: "Generator", entry: ParkedEntry, keep: int) -> bool:
        """Install ``entry`` after releasing the live state to ``keep`` tokens (the prefix a
        tail entry's chain starts from; 0 for a whole one). False (engine reset) on failure."""
        self.before_cut(gen, keep)
        if not entry.is_tail:
            return install(gen, entry)
        gen.failed = True
        try:
            self.lineage.install(gen, entry)
            gen.hits, gen.session_key = entry.hits, entry.session
            gen.failed = False
            return True
        except Exception as error:  # a failed restore never fails the request: run cold
            log.warning("restore failed %d tok reason=%s: %s; running cold", len(entry.held_ids),
                        type(error).__name__, error)
            reset(gen)
            return False

    def _candidates(self, prompt: list[int], live_usable: int, engine) -> list[Candidate]:
        """The live state and the parked entries that could beat it (index lookups); entries
        longer than the engine's context (saved with a larger ``--ctx-size``) cannot load."""
        can_rewind = engine.can_rewind
        candidates = [Candidate(LIVE, live_usable, "live", self._clock())]
        session = self._session
        if self.pool is not None and session is not None:
            for entry in self.pool.entries():
                if entry.session == session:
                    usable = tail_usable(entry, usable_prefix(
                        len(entry.held_ids), common_prefix_length(entry.held_ids, prompt),
                        len(prompt), can_rewind, entry.checkpoint_positions))
                    candidates.append(Candidate(entry.key, usable, "ram", entry.last_used,
                                                len(entry.held_ids), session=True))
        if self.pool is not None:
            candidates += self.pool.candidates(prompt, can_rewind, live_usable)
        if self.sessions is not None:
            best = max(c.usable for c in candidates)
            candidates += self.sessions.candidates(prompt, can_rewind, best)
        return [c for c in candidates if c.held_len <= engine.max_context]

    @staticmethod
    def _live_would_lose(gen: "Generator", live_common: int, kept: int) -> bool:
        """Whether switching would lose live tokens: not when the live state is empty or
        untrusted, nor when all of it lies within the prefix kept for the prompt."""
        held = len(gen.held_ids)
        if gen.failed or held == 0:
            return False
        return not (live_common == held and held <= kept)

    def _fetch(self, choice: Candidate) -> ParkedEntry | None:
        """The chosen entry. A RAM entry the prompt extends leaves the pool (the live state
        will supersede it); one the request cuts back stays parked (the engine copies it)."""
        if choice.tier == "ram":
            if choice.usable >= choice.held_len:
                entry = self.pool.pop(choice.key)
            else:
                entry = self.pool.get(choice.key)
            entry.last_used = self._clock()
            return entry
        return self.sessions.load(choice.key)

    # --- parking -----------------------------------------------------------------------------

    def park_live(self, gen: "Generator", protected: frozenset, keep: int = 0) -> None:
        """Park what the live conversation holds past ``keep`` tokens (never raises; logged):
        the whole state when ``keep`` is 0, else a tail entry on the live prefix (see
        :mod:`redlite.core.forks`). On the device while ``--park-device-mib`` has room for it
        (engines with device memory), else in host memory. The size is checked first
        (``Engine.range_nbytes``): a state that neither the pool would admit nor the disk tier
        would take is dropped without being copied."""
        started = self._timer()
        self._gen = gen
        n = len(gen.held_ids)
        if keep >= n:
            return
        engine = gen.engine
        try:
            state = engine.range_nbytes(keep) if keep else engine.state_nbytes()
            estimate = (state + sum(c.nbytes for c in gen.checkpoints.items() if c.position > keep)
                        + ID_BYTES_PER_TOKEN * n)
        except Exception as error:
            log.warning("park failed %d tok reason=%s: %s", n, type(error).__name__, error)
            return
        pool = self.pool
        on_device = bool(pool is not None and engine.device_resident
                         and pool.device_nbytes + estimate <= pool.device_budget_bytes)
        parent = LIVE if keep else None
        stats = EntryStats("live", estimate, n, self._clock(), keep, parent, on_device)
        to_disk = self.sessions is not None and self.sessions.eligible(n)
        if not to_disk and not self._would_admit(stats, gen.held_ids, protected, engine.can_rewind):
            log.info("evicted %d tok (%d bytes) from live reason=no-room -> dropped (not copied)",
                     n - keep, estimate)
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
                    log.warning("park on device failed (%s: %s); host memory instead",
                                type(error).__name__, error)
                    entry = capture_tail(gen, key, self._clock(), keep, False)
        except Exception as error:
            log.warning("park failed %d tok reason=%s: %s", n, type(error).__name__, error)
            return
        self.park(entry, protected, engine.can_rewind, started)

    def _superseded(self, held_ids: list[int], protected: frozenset, can_rewind: bool) -> list:
        """Pool entries a conversation holding ``held_ids`` makes redundant (it extends them)."""
        if self.pool is None or not can_rewind:
            return []
        return [key for key in self.pool.prefixes_of(held_ids) if key not in protected]

    def _admission(self, stats: EntryStats, superseded: list, protected: frozenset) -> EvictionPlan:
        """The pool's eviction plan for an entry, counting the superseded entries as gone."""
        gone = set(superseded)
        current = [self.pool.stats(e) for e in self.pool.entries() if e.key not in gone]
        return plan_eviction(current, stats, self.pool.budget_bytes, self.pool.max_entries, protected,
                             self.pool.device_budget_bytes)

    def _would_admit(self, stats: EntryStats, held_ids: list[int], protected: frozenset,
                     can_rewind: bool) -> bool:
        if self.pool is None:
            return False
        superseded = self._superseded(held_ids, protected, can_rewind)
        return self._admission(stats, superseded, protected).admit

    def park(self, entry: ParkedEntry, protected: frozenset, can_rewind: bool,
             started: float | None = None) -> None:
        """Put ``entry`` into the RAM pool when its eviction plan admits it, spilling what it
        evicts to disk; otherwise straight to disk (when big enough). Entries it supersedes
        (it extends them; engines that can rewind) leave the pool only once it is admitted."""
        n = len(entry.held_ids)
        if self.pool is None:
            self._spill(entry, "no-ram-pool", protected, can_rewind)
            return
        superseded = self._superseded(entry.held_ids, protected, can_rewind)
        plan = self._admission(self.pool.stats(entry), superseded, protected)
        if not plan.admit:
            self._spill(entry, "no-room", protected, can_rewind)
            return
        for key in superseded:
            old = self.pool.pop(key)
            log.info("evicted %d tok from ram reason=superseded", len(old.held_ids))
        for key in plan.evict:
            self._spill(self.pool.pop(key), "value", protected, can_rewind)
        self.pool.add(entry)
        if entry.parent == LIVE or entry.base == 0:  # it holds a copy of the live state
            self.lineage.release_live(self._gen, entry.base, heir=entry) if self._gen else None
        seconds = self._timer() - started if started is not None else 0.0
        if started is not None:
            self._timed("park", "device" if entry.on_device else "ram", seconds)
        ms = seconds * 1000.0
        log.info("parked %d tok (%d bytes) in %.1f ms: tokens [%d, %d) tier=%s; ram pool %d "
                 "entries, %d bytes host, %d bytes device", n - entry.base, entry.nbytes, ms,
                 entry.base, n, "device" if entry.on_device else "ram", len(self.pool),
                 self.pool.host_nbytes, self.pool.device_nbytes)

    def _spill(self, entry: ParkedEntry, reason: str, protected: frozenset, can_rewind: bool) -> None:
        """An entry leaving the pool (or not admitted): to disk when big enough, saved whole
        (a tail entry joined with its chain's prefix), else dropped."""
        n = len(entry.held_ids)
        to_disk = self.sessions is not None and self.sessions.eligible(n)
        log.info("evicted %d tok (%d bytes) from ram reason=%s -> %s", n - entry.base, entry.nbytes,
                 reason, "disk" if to_disk else "dropped")
        if to_disk:
            try:
                whole = self.lineage.whole(self._gen, entry) if entry.is_tail or entry.on_device \
                    else entry
            except Exception as error:  # noqa: BLE001 - its prefix is gone: not saved
                log.warning("save skipped %d tok reason=%s: %s", n, type(error).__name__, error)
                return
            started = self._timer()
            if self.sessions.save(whole, supersede=can_rewind, protected=protected) is not None:
                self._timed("save", "disk", self._timer() - started)

    def _timed(self, kind: str, tier: str, seconds: float) -> None:
        if self.on_timing is not None:
            try:
                self.on_timing(kind, tier, seconds)
            except Exception:  # noqa: BLE001 - counting never fails a conversation move
                log.exception("timing listener failed")

    # --- stop --------------------------------------------------------------------------------

    def save_all(self, gen: "Generator", live: bool = True, should_stop=None,
                 guard=contextlib.nullcontext) -> int:
        """Stop: write the live conversation (when ``live``: the engine is idle; and only when
        consistent) and every RAM entry big enough to disk, newest first. ``should_stop()``
        (optional) is asked before each file: True ends the saving (a second signal); each
        file is written inside ``guard()`` (a context manager: the process does not end
        while a file is being written). Returns the files written or found identical."""
        if self.sessions is None:
            return 0
        entries: list[ParkedEntry] = []
        consistent = not gen.failed and len(gen.held_ids) == gen.engine.n_past
        if live and consistent and self.sessions.eligible(len(gen.held_ids)):
            try:
                entries.append(capture(gen, "live", self._clock()))
            except Exception as error:
                log.warning("save failed %d tok reason=%s: %s", len(gen.held_ids),
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
                if self.sessions.save(entry, supersede=gen.engine.can_rewind) is not None:
                    self._timed("save", "disk", self._timer() - started)
                    saved += 1
        return saved
