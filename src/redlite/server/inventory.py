"""The conversations the server holds, read at request time (``GET /v1/conversations``,
``GET /slots``, the metrics collector).

Tiers (:data:`TIERS`): ``live`` (the engine's state, on the device: one per sequence slot,
``slot`` its index; ``null`` for the other tiers), ``device`` and ``ram``
(the parking pool: entries kept in device memory within ``--park-device-mib``, and in host
memory), ``disk`` (session files). Read from the engine worker's objects without a lock: the
worker may change them meanwhile, so a read that races a change is retried (a snapshot is a
few list copies, no per-token work). Bytes: engine state + checkpoints (live), entry payload
(ram), file size (disk). Times: ``last_used`` in seconds since the epoch (live: when its
last request ended, :attr:`redlite.core.sequence.Sequence.used_at`).
``session_key``: the client's session key of the conversation (files keep it too); ``hits``:
how many requests reused its held state (live and pool; files do not keep it: None, and a
conversation read back from a file counts from 0).
"""

from __future__ import annotations

from typing import Any

TIERS = ("live", "device", "ram", "disk")


def _conversation(tier: str, key: Any, tokens: int, nbytes: int, checkpoints: list[int],
                  last_used: float | None, session_key: str | None = None,
                  hits: int | None = None, slot: int | None = None) -> dict:
    return {"id": str(key), "tier": tier, "session_key": session_key, "tokens": int(tokens),
            "bytes": int(nbytes), "checkpoints": [int(p) for p in checkpoints],
            "last_used": last_used, "hits": hits, "slot": slot}


def live_id(slot: int) -> str:
    """The id of slot ``slot``'s live conversation: ``live`` for slot 0, ``live-<slot>`` else."""
    return f"live-{slot}" if slot else "live"


def _read(generators: list) -> list[dict]:
    out = []
    for slot, generator in enumerate(generators):
        held = len(generator.held_ids)
        if held:
            positions = list(generator.checkpoints.positions)
            live_bytes = int(generator.engine.state_nbytes()) + sum(
                int(getattr(c, "nbytes", 0)) for c in generator.checkpoints.items())
            used_at = getattr(getattr(generator, "sequence", None), "used_at", None)
            out.append(_conversation("live", live_id(slot), held, live_bytes, positions, used_at,
                                     getattr(generator, "session_key", None),
                                     getattr(generator, "hits", None), slot))
    parking = getattr(generators[0], "parking", None)
    pool = getattr(parking, "pool", None)
    for entry in (pool.entries() if pool is not None else []):
        out.append(_conversation(entry.tier, entry.key, len(entry.held_ids), entry.nbytes,
                                 entry.checkpoint_positions, entry.last_used, entry.session,
                                 entry.hits))
    sessions = getattr(parking, "sessions", None)
    for entry in (sessions.entries() if sessions is not None else []):
        out.append(_conversation("disk", entry.key, len(entry.held_ids), entry.nbytes,
                                 entry.checkpoint_positions, entry.last_used,
                                 getattr(entry, "session", None)))
    return out


def conversations(generators: list, attempts: int = 5) -> list[dict]:
    """Every held (one per sequence slot: ``generators[i]`` serves slot i), parked and stored
    conversation (see module docstring), live first."""
    for attempt in range(attempts):
        try:
            return _read(generators)
        except (RuntimeError, KeyError, IndexError):  # changed under us by the worker: again
            if attempt == attempts - 1:
                raise
    return []


def budgets(generator: Any) -> dict[str, int | None]:
    """Byte budget per tier (None: unbounded or tier absent): ``device``
    ``--park-device-mib`` (None for an engine without device memory), ``ram`` ``--park-mib``,
    ``disk`` ``--session-max-gb``; ``live`` None (the engine's state is preallocated)."""
    parking = getattr(generator, "parking", None)
    pool = getattr(parking, "pool", None)
    sessions = getattr(parking, "sessions", None)
    on_device = pool is not None and getattr(generator.engine, "device_resident", False)
    return {"live": None,
            "device": pool.device_budget_bytes if on_device else None,
            "ram": pool.budget_bytes if pool is not None else None,
            "disk": sessions.max_bytes if sessions is not None else None}


def tier_totals(items: list[dict]) -> dict[str, tuple[int, int, int]]:
    """(conversations, tokens, bytes) per tier, every tier present (zeros when empty)."""
    totals = {tier: [0, 0, 0] for tier in TIERS}
    for item in items:
        row = totals[item["tier"]]
        row[0] += 1
        row[1] += item["tokens"]
        row[2] += item["bytes"]
    return {tier: tuple(row) for tier, row in totals.items()}
