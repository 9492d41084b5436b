"""Forks cost what they change: tail entries and the one invariant that keeps them valid.

A fork (a regenerate, an edited last message, a sub-request) keeps the prefix ``[0, keep)`` of
the live conversation and discards the tail ``[keep, held)``. Parking keeps only that tail: a
*tail entry* (:class:`~redlite.core.parking.ParkedEntry` with ``parent`` set) holds the state
of tokens ``[base, held)`` (``Engine.snapshot_range``: KV rows, plus the recurrent state at its
end for a hybrid model) and the checkpoints past ``base``; its prefix ``[0, base)`` is the state
of its parent: ``LIVE`` (the live conversation) or another pool entry (whose own chain holds
it). Chains end in ``LIVE`` or in a whole entry (``parent`` None).

Invariant (owned by :class:`Lineage`; nothing else changes ``parent``/``base``):

* an entry whose parent is ``LIVE`` has ``base <=`` the live length, the live held ids agree
  with its held ids on ``[0, base)``, and the live state of those tokens is the one the tail
  was computed against (never recomputed since);
* an entry whose parent is a key: that entry is in the pool, has a smaller ``base`` and agrees
  likewise on ``[0, base)``.

Whatever cuts the live state to ``keep`` tokens or replaces it (a rewind, a checkpoint restore,
a reset, installing another conversation, a failure) first calls :meth:`Lineage.release_live`:
the live dependants past ``keep`` are handed to an *heir* (the entry that just parked the live
state, which holds their prefix), or rebased onto ``[0, keep)`` by copying the live rows
``[keep, base)`` into them (a whole entry when ``keep`` is 0), or, when the live state is not
trusted (after a failure), dropped with their own dependants (one log line each, with the
reason). Pool eviction only takes leaves (:func:`~redlite.core.eviction.plan_fit`), so a parent
never leaves before its dependants; an entry taken out to become the live state hands its
dependants to ``LIVE`` (:meth:`Lineage.adopt`).

Disk: a tail entry is saved whole (:meth:`Lineage.whole`: its chain's pieces joined in host
memory), so every file stands alone; one whose chain starts at an untrusted live state is not
saved (logged).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Hashable

from redlite.core.eviction import plan_fit
from redlite.core.parking import LIVE, ParkedCheckpoint, ParkedEntry, ParkingPool, tensor_nbytes

if TYPE_CHECKING:
    from redlite.core.generation import Generator

log = logging.getLogger("redlite.parking")


def parked_checkpoint(engine, checkpoint, on_device: bool) -> ParkedCheckpoint:
    """A checkpoint for a parked entry: the engine's object as is for device-resident entries
    (no copy) or engines without a host form, else its host tensors."""
    host = None if on_device else engine.checkpoint_to_tensors(checkpoint)
    if host is None:
        return ParkedCheckpoint(checkpoint.position, checkpoint.turn_boundary, checkpoint.nbytes,
                                obj=checkpoint)
    tensors, meta = host
    return ParkedCheckpoint(checkpoint.position, checkpoint.turn_boundary, tensor_nbytes(tensors),
                            tensors, meta)


def engine_checkpoint(engine, checkpoint: ParkedCheckpoint):
    """The engine's checkpoint object for a parked one (rebuilt from host tensors if needed)."""
    if checkpoint.obj is not None:
        return checkpoint.obj
    return engine.checkpoint_from_tensors(checkpoint.position, checkpoint.tensors, checkpoint.meta,
                                          checkpoint.turn_boundary)


def trusted(gen: "Generator") -> bool:
    """Whether the live state is what its held ids say (no failure half-way)."""
    return not gen.failed and len(gen.held_ids) == gen.engine.n_past


class Lineage:
    """The tail entries of one pool and the live state they may depend on (see module
    docstring). ``spill(entry, reason)`` is called for an entry that leaves the pool to make
    room after a rebase grew it (the owner writes it to disk or drops it)."""

    def __init__(self, pool: ParkingPool | None, spill=None) -> None:
        self.pool = pool
        self.spill = spill

    # --- chains ------------------------------------------------------------------------------

    def chain(self, entry: ParkedEntry) -> list[ParkedEntry]:
        """``entry`` and its ancestors in the pool, root first (the root's parent is ``LIVE``
        or None). Raises KeyError when an ancestor is missing (a broken invariant)."""
        out = [entry]
        while out[-1].parent not in (None, LIVE):
            out.append(self.pool.get(out[-1].parent))
        return out[::-1]

    def pieces(self, engine, links: list[ParkedEntry]) -> tuple[list, list[ParkedCheckpoint]]:
        """The state ranges and checkpoints a chain contributes above its root's base: link i
        gives ``[base_i, base_{i+1})`` (the last link all of its own)."""
        ranges, checkpoints = [], []
        for link, above in zip(links, links[1:] + [None]):
            if above is None:
                ranges.append(link.snapshot)
                checkpoints += link.checkpoints
            else:
                ranges.append(engine.slice_range(link.snapshot, link.base, above.base))
                checkpoints += [c for c in link.checkpoints if c.position <= above.base]
        return ranges, checkpoints

    def whole(self, gen: "Generator", entry: ParkedEntry) -> ParkedEntry:
        """A whole entry in host memory equal to ``entry``'s state (for the disk tier); the
        entry itself when it is whole and in host memory already. Raises RuntimeError when
        its chain starts at a live state that is not trusted."""
        if not entry.is_tail and not entry.on_device:
            return entry
        engine = gen.engine
        links = self.chain(entry) if entry.is_tail else [entry]
        ranges, checkpoints = self.pieces(engine, links)
        if links[0].parent == LIVE:
            if not trusted(gen) or gen.held_ids[:links[0].base] != entry.held_ids[:links[0].base]:
                raise RuntimeError("its prefix, the live state, is not available")
            base = links[0].base
            ranges.insert(0, engine.snapshot_range(0, base))
            checkpoints = [parked_checkpoint(engine, c, False) for c in gen.checkpoints.items()
                           if c.position <= base] + checkpoints
        snapshot = engine.join_ranges(ranges)
        host = []
        for c in checkpoints:
            if c.tensors is None and c.obj is not None:
                c = parked_checkpoint(engine, c.obj, False)
            host.append(c)
        return dataclasses.replace(entry, snapshot=snapshot, checkpoints=host, base=0, parent=None,
                                   on_device=False)

    # --- the invariant -----------------------------------------------------------------------

    def release_live(self, gen: "Generator", keep: int, heir: ParkedEntry | None = None) -> None:
        """The live state is about to hold only its first ``keep`` tokens (0: replaced). Every
        pool entry depending on it beyond ``keep`` goes to ``heir`` (a pool entry that holds a
        copy of the live state), else is rebased onto ``[0, keep)`` from the engine, else
        (live state not trusted, or the copy fails) is dropped with its dependants."""
        if self.pool is None:
            return
        dependants = [e for e in self.pool.children(LIVE) if e.base > keep]
        if not dependants:
            return
        ok = trusted(gen)
        for entry in dependants:
            if heir is not None and heir.key in self.pool and len(heir.held_ids) >= entry.base:
                entry.parent = heir.key
            elif ok:
                self._rebase(gen, entry, keep)
            else:
                self.drop(entry, "live-state-lost")
        if ok and heir is None:
            self._fit()

    def _rebase(self, gen: "Generator", entry: ParkedEntry, keep: int) -> None:
        started = time.perf_counter()
        engine, old = gen.engine, entry.base
        try:
            piece = engine.snapshot_range(keep, old, on_device=entry.on_device)
            joined = engine.join_ranges([piece, entry.snapshot], on_device=entry.on_device)
            extra = [parked_checkpoint(engine, c, entry.on_device) for c in gen.checkpoints.items()
                     if keep < c.position <= old]
        except Exception as error:  # noqa: BLE001 - out of memory, say: the entry goes
            log.warning("tail of %d tok could not take its prefix: %s: %s", len(entry.held_ids),
                        type(error).__name__, error)
            self.drop(entry, "copy-failed")
            return
        entry.snapshot, entry.checkpoints = joined, extra + entry.checkpoints
        entry.base, entry.parent = keep, (LIVE if keep > 0 else None)
        log.info("materialized %d tok of live prefix into a parked entry of %d tok (now from %d, "
                 "%d bytes) in %.1f ms", old - keep, len(entry.held_ids), keep, entry.nbytes,
                 (time.perf_counter() - started) * 1000.0)

    def _fit(self) -> None:
        """After rebases grew entries: spill leaves until the pool fits its budgets."""
        pool = self.pool
        evict = plan_fit([pool.stats(e) for e in pool.entries()], pool.budget_bytes,
                         pool.max_entries, frozenset(), pool.device_budget_bytes) or []
        for key in evict:
            entry = pool.pop(key)
            if self.spill is not None:
                self.spill(entry, "value")

    def drop(self, entry: ParkedEntry, reason: str) -> None:
        """Remove ``entry`` and everything depending on it from the pool (logged)."""
        for child in self.pool.children(entry.key):
            self.drop(child, reason)
        if entry.key in self.pool:
            self.pool.pop(entry.key)
        log.info("dropped parked %d tok (tokens [%d, %d)) reason=%s", len(entry.held_ids) - entry.base,
                 entry.base, len(entry.held_ids), reason)

    def adopt(self, key: Hashable, installed: bool = True) -> None:
        """Entry ``key`` left the pool to become the live state: when ``installed`` its
        dependants depend on the live state now; otherwise (its restore failed) they lost their
        prefix and are dropped."""
        if self.pool is None:
            return
        for child in self.pool.children(key):
            if installed:
                child.parent = LIVE
            else:
                self.drop(child, "parent-restore-failed")

    # --- installing a chain ------------------------------------------------------------------

    def install(self, gen: "Generator", entry: ParkedEntry) -> None:
        """Make a tail entry's state the live state: the live prefix ``[0, root base)`` stays
        (chain rooted in ``LIVE``) or the root's whole state is restored, then each link's range
        is written after it. The caller has released the live state to that prefix. Raises
        whatever the engine raises (the caller resets)."""
        engine = gen.engine
        links = self.chain(entry)
        ranges, checkpoints = self.pieces(engine, links)
        root = links[0]
        live_checkpoints = []  # a whole root: its first piece starts at 0 (replaces everything)
        if root.parent == LIVE:
            live_checkpoints = [c for c in gen.checkpoints.items() if c.position <= root.base]
        for piece in ranges:
            engine.restore_range(piece)
        restored = [engine_checkpoint(engine, c) for c in checkpoints]
        if engine.n_past != len(entry.held_ids):
            raise RuntimeError(f"engine holds {engine.n_past} tokens after restore, "
                               f"expected {len(entry.held_ids)}")
        gen.held_ids = list(entry.held_ids)
        gen.checkpoints.clear()
        for checkpoint in live_checkpoints + restored:
            gen.checkpoints.add(checkpoint)
