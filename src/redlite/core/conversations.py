"""Switching conversations: the candidate-selection step before a request's reuse plan.

:meth:`Conversations.select` runs on the engine worker thread at the start of every request
(see :meth:`redlite.core.generation.Generator.run`):

1. candidates: the live state, another slot's live state when the scheduler offers one
   (``--parallel``: :mod:`redlite.core.placement`), and the parked entries (the pool, then
   disk) that the prefix indexes name for the prompt, each with its usable prefix
   (:func:`usable_prefix`);
2. the best (:func:`choose_candidate`) is fetched: from the pool (popped when the prompt
   extends it, else left parked and protected from eviction during this request), or read and
   verified from disk (a refused file drops out and the choice is made again);
3. the live state is parked unless nothing of it would be lost (the prompt extends it, or the
   chosen state contains it): only what the switch discards, ``[keep, held)``
   (:meth:`~redlite.core.parker.Parker.park_live`);
4. the chosen entry is installed (:func:`redlite.core.live_state.install`: engine state, held
   ids and checkpoints replaced together; a tail entry's chain written after the prefix they
   share), or the other slot's usable prefix copied engine to engine
   (:func:`redlite.core.live_state.copy_prefix`, that slot unchanged); a failed restore or copy
   resets the engine and the request runs cold.

Parked and saved entries carry the conversation's session key and its exact-replay turns
(:mod:`redlite.core.replay`, once :meth:`Conversations.attach_replay` named the store): the
turns its held ids hold are collected when it is parked or saved, put back into the store when
it is restored, and the store is seeded from the disk tier's files at start.

The Generator then plans reuse against the (possibly new) held state as usual. Nothing here
raises into the request: failures are logged and end in a consistent (possibly empty) state.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from redlite.core.forks import trusted
from redlite.core.live_state import SlotPrefix, copy_prefix, install, reset
from redlite.core.parker import Parker
from redlite.core.parking import (LIVE, POOL_TIERS, Candidate, ParkedEntry, ParkingPool,
                                  choose_candidate, entry_fit, longest_usable, usable_prefix)
from redlite.core.replay import ReplayStore
from redlite.core.reuse import common_prefix_length
from redlite.core.sessions import SessionStore

if TYPE_CHECKING:
    from redlite.core.generation import Generator

log = logging.getLogger("redlite.parking")


class Conversations(Parker):
    """The candidate-selection step over the parking tiers of one generator (``pool``: device
    and host memory, may be None; ``sessions``: disk, may be None). Used from the engine worker
    thread only. Restores are timed through ``on_timing`` (:class:`~redlite.core.parker.Parker`)."""

    def __init__(self, pool: ParkingPool | None, sessions: SessionStore | None,
                 clock=time.time, timer=time.perf_counter) -> None:
        super().__init__(pool, sessions, clock, timer)
        self._session: str | None = None  # the current request's session key
        self._notes: list | None = None  # the current request's notes (see select)

    def attach_replay(self, store: ReplayStore) -> int:
        """Use ``store`` for the exact-replay turns of parked and saved conversations, and
        seed it with the turns of the indexed files (least recently used first, within its
        budget). Returns the turns added."""
        self.replay = store
        if self.sessions is None:
            return 0
        turns = []
        for entry in sorted(self.sessions.entries(), key=lambda e: e.last_used):
            turns += entry.replay
            entry.replay = []  # the store owns them now
        added = store.restore(turns)
        if turns:
            log.info("replay: %d turns of saved conversations kept (%d in files)", added, len(turns))
        return added

    # --- the candidate-selection step --------------------------------------------------------

    def select(self, gen: "Generator", prompt: list[int], request_id: str = "req",
               session: str | None = None, source: SlotPrefix | None = None,
               notes: list | None = None) -> None:
        """Bring the best candidate for ``prompt`` into the engine (see module docstring).
        session: the request's session key; that session's parked RAM entry is the first
        candidate (it wins ties). source: another slot's conversation (idle while this runs)
        whose usable prefix is a candidate too. notes: where the line saying what was restored
        goes, as ``(logger, text)`` (the request's ``GenerationRequest.notes``, written after
        its first token); None: logged at once."""
        self._session, self.request_id, self._notes = session, request_id, notes
        try:
            self._select(gen, prompt, request_id, source)
        except Exception:  # never fails the request; the generator's plan sees the state
            log.exception("%s parking failed; continuing with the live state", request_id)
            if gen.failed:
                try:
                    reset(gen)
                except Exception:
                    pass

    def _select(self, gen: "Generator", prompt: list[int], request_id: str,
                source: SlotPrefix | None) -> None:
        self._gen = gen
        if not trusted(gen):  # the live state is not what tail entries were taken against
            self.lineage.release_live(gen, 0)
        held = gen.held_ids
        live_common = 0 if gen.failed else gen.common_with(prompt)
        live_usable = usable_prefix(len(held), live_common, len(prompt), gen.engine.can_rewind,
                                    gen.checkpoints.positions)
        while True:  # again only after a refused file (it has left the index)
            choice = choose_candidate(self._candidates(prompt, live_usable, gen, source,
                                                       live_common if trusted(gen) else None))
            if choice is None or choice.key == LIVE:
                kept = choice.usable if choice is not None else 0
                if self._live_would_lose(gen, live_common, kept):
                    self.park_live(gen, frozenset(), keep=kept, defer=True)
                return
            if choice.tier == "slot":
                self._copy(gen, source, choice.usable, live_common, request_id)
                return
            started = self._timer()
            tier = self.pool if choice.tier in POOL_TIERS else self.sessions
            hashes = tier.hashes_of(choice.key)  # (a file's ids are checked against its index's)
            entry = self._fetch(choice)
            if entry is None:
                continue
            links = self.lineage.chain(entry) if entry.is_tail else [entry]
            keep = links[0].base if links[0].parent == LIVE else 0
            if self._live_would_lose(gen, live_common, choice.usable):
                self.park_live(gen, frozenset(e.key for e in links), keep=keep)
            popped = choice.tier in POOL_TIERS and choice.key not in self.pool
            installed = install(gen, entry, keep)
            if popped:  # its dependants now build on the live state, or lost their prefix
                self.lineage.adopt(choice.key, installed)
            if installed:  # what the candidate step learnt of its ids: not computed again
                if choice.common is not None:
                    gen.know_common(prompt, choice.common)
                if hashes:
                    gen.sequence.know_hashes(tier.block, hashes)
                if self.replay is not None and entry.replay:
                    self.replay.restore(entry.replay)  # its turns: used again
                seconds = self._timer() - started
                self._timed("restore", choice.tier, seconds)
                tail = f" tail [{entry.base}, {len(entry.held_ids)})" if entry.is_tail else ""
                text = (f"restored from {choice.tier} {len(entry.held_ids)} tok in {seconds * 1000.0:.1f} ms "
                        f"(usable {choice.usable}){tail}" + (f" session={entry.session}" if entry.session else ""))
                if self._notes is not None:
                    self._notes.append((log, text))
                else:
                    log.info("%s %s", request_id, text)
            elif choice.tier == "disk" and choice.key not in self.sessions:
                self._select(gen, prompt, request_id, source)  # a refused file left the index
            return

    def _copy(self, gen: "Generator", source: SlotPrefix, keep: int, live_common: int,
              request_id: str) -> None:
        """Start from ``source``'s first ``keep`` tokens, parking the live state if it would
        lose tokens."""
        if self._live_would_lose(gen, live_common, keep):
            self.park_live(gen, frozenset(), keep=0)
        started = self._timer()
        if copy_prefix(gen, source, keep):
            log.info("%s copied %d tok from slot %d in %.1f ms (that slot keeps its %d tok)",
                     request_id, keep, source.slot, (self._timer() - started) * 1000.0,
                     len(source.generator.held_ids))

    def _candidates(self, prompt: list[int], live_usable: int, gen: "Generator",
                    source: SlotPrefix | None = None, live_common: int | None = None) -> list[Candidate]:
        """The live state, ``source``'s and the parked entries that could beat it (index
        lookups, given the hashes of the blocks the prompt shares with the live state);
        entries longer than the engine's context (saved with a larger ``--ctx-size``) cannot
        load. live_common: the trusted live state's common prefix with the prompt (None:
        unknown)."""
        engine = gen.engine
        can_rewind = engine.can_rewind
        candidates = [Candidate(LIVE, live_usable, "live", self._clock())]
        if source is not None and trusted(source.generator):
            donor = source.generator
            common = common_prefix_length(donor.held_ids, prompt)
            usable = usable_prefix(len(donor.held_ids), common, len(prompt), can_rewind,
                                   donor.checkpoints.positions)
            candidates.append(Candidate(("slot", source.slot), usable, "slot",
                                        donor.sequence.used_at, usable))
        session = self._session
        if session is not None:  # the session's own entries, RAM and disk, come first
            tiers = [t for t in (self.pool, self.sessions) if t is not None]
            for entry in (e for tier in tiers for e in tier.entries()):
                if entry.session == session:
                    common, usable = entry_fit(entry, prompt, can_rewind, live_common)
                    candidates.append(Candidate(entry.key, usable, entry.tier, entry.last_used,
                                                len(entry.held_ids), session=True, common=common))

        def known(block: int) -> list[bytes]:  # the prompt's leading hashes: the live state's
            return gen.sequence.held_hashes(block, live_common // block) if live_common else []
        # the pool's entries could at most tie with a live state keeping all it can (a regenerate)
        if self.pool is not None and live_usable < longest_usable(len(prompt), can_rewind):
            candidates += self.pool.candidates(prompt, can_rewind, live_usable, live_common,
                                               known(self.pool.block))
        if self.sessions is not None:
            best = max(c.usable for c in candidates)
            candidates += self.sessions.candidates(prompt, can_rewind, best, known(self.sessions.block))
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
        if choice.tier in POOL_TIERS:
            if choice.usable >= choice.held_len:
                entry = self.pool.pop(choice.key)
            else:
                entry = self.pool.get(choice.key)
            entry.last_used = self._clock()
            return entry
        return self.sessions.load(choice.key)
