"""The live conversation in and out of the engine: copy it (whole or its tail), install a
parked one, start from another slot's prefix, drop it.

Invariant owned here (with :meth:`redlite.core.generation.Generator._execute` for a request's
own rewinds): the generator's held ids, its checkpoints and the engine state change together.
:func:`install`, :func:`copy_prefix` and :func:`reset` leave them agreeing whatever fails
(``gen.failed`` marks the window in between), and first release the live state to what they
keep (``gen.parking.before_cut``), so parked tails that depend on it stay valid
(:mod:`redlite.core.forks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable

from redlite.core.forks import parked_checkpoint
from redlite.core.parking import LIVE, ParkedEntry

if TYPE_CHECKING:
    from redlite.core.generation import Generator

log = logging.getLogger("redlite.parking")


def capture(gen: "Generator", key: Hashable, now: float) -> ParkedEntry:
    """Copy the live conversation (engine snapshot, held ids, checkpoints) to host memory: a
    whole entry. Raises whatever ``engine.snapshot`` raises."""
    engine = gen.engine
    checkpoints = [parked_checkpoint(engine, c, False) for c in gen.checkpoints.items()]
    return ParkedEntry(key, list(gen.held_ids), engine.snapshot(), checkpoints, now, now,
                       session=gen.session_key, hits=gen.hits)


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
                       session=gen.session_key, hits=gen.hits, base=keep,
                       parent=LIVE if keep > 0 else None, on_device=on_device)


def _install_whole(gen: "Generator", entry: ParkedEntry) -> None:
    engine = gen.engine
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


def install(gen: "Generator", entry: ParkedEntry, keep: int = 0) -> bool:
    """Make ``entry`` the live conversation: the live state is released to ``keep`` tokens
    first (the live prefix a tail entry's chain starts from; 0 for a whole entry), then a
    whole entry is restored, or a tail entry's chain written after that prefix
    (:meth:`redlite.core.forks.Lineage.install`). On any failure the engine is reset (held
    ids and checkpoints emptied) and False returned: held ids and engine state always agree."""
    parking = gen.parking
    if parking is not None:
        parking.before_cut(gen, keep)
    gen.failed = True
    try:
        if entry.is_tail:
            parking.lineage.install(gen, entry)
        else:
            _install_whole(gen, entry)
        gen.hits, gen.session_key = entry.hits, entry.session  # the conversation's own
        gen.failed = False
        return True
    except Exception as error:  # a failed restore never fails the request: run cold
        log.warning("restore failed %d tok reason=%s: %s; running cold", len(entry.held_ids),
                    type(error).__name__, error)
        reset(gen)
        return False


@dataclass(frozen=True)
class SlotPrefix:
    """Another slot's live conversation offered to a request's candidate step (``--parallel``):
    ``generator`` serves that slot, ``engine`` is its engine itself (not a proxy), ``slot`` its
    index. The scheduler keeps that slot idle until the step is over."""

    generator: "Generator"
    engine: Any
    slot: int


def copy_prefix(gen: "Generator", source: SlotPrefix, keep: int) -> bool:
    """Make the first ``keep`` tokens of ``source``'s conversation the live one (a fork by copy,
    ``source`` unchanged): the engine copies their state from the source slot
    (``Engine.copy_prefix``), plus, for an engine that cannot rewind, the recurrent state of the
    source's checkpoint at ``keep`` (required unless ``keep`` is all it holds); held ids and
    checkpoints up to ``keep`` follow (the checkpoint objects themselves: never changed). The
    live state is released first. On any failure the engine is reset and False returned, as
    for :func:`install`."""
    donor = source.generator
    if gen.parking is not None:
        gen.parking.before_cut(gen, 0)
    gen.failed = True
    try:
        cut = not gen.engine.can_rewind and keep < len(donor.held_ids)
        checkpoint = donor.checkpoints.get(keep) if cut else None
        if cut and checkpoint is None:
            raise RuntimeError(f"slot {source.slot} has no checkpoint at {keep}")
        gen.engine.copy_prefix(source.engine, keep)
        if checkpoint is not None:
            gen.engine.restore_checkpoint(checkpoint)
        if gen.engine.n_past != keep:
            raise RuntimeError(f"engine holds {gen.engine.n_past} tokens after the copy, expected {keep}")
        gen.held_ids = list(donor.held_ids[:keep])
        gen.checkpoints.clear()
        for kept in donor.checkpoints.items():
            if kept.position <= keep:
                gen.checkpoints.add(kept)
        gen.hits, gen.session_key = 0, None  # a new conversation on the shared prefix
        gen.failed = False
        return True
    except Exception as error:  # never fails the request: run cold
        log.warning("copy of %d tok from slot %d failed reason=%s: %s; running cold", keep,
                    source.slot, type(error).__name__, error)
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
