"""Eviction from the parking pool: pure plans over plain data (no entries, no engine).

The pool is bounded by host bytes (``--park-mib``), device bytes (``--park-device-mib``, for
entries kept in device memory) and entries (``--park-slots``). Eviction (:func:`plan_eviction`)
drops the entry of lowest *value*: the prefill time it saves per byte it occupies, divided by
``1 + recency rank`` (rank 0: the most recently used; a tail entry saves only the prefill past
its base). It never evicts a protected entry (the one prefixing the running request's prompt)
nor an entry others depend on before them (leaves first), and an entry that would be evicted
at once is not stored at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, NamedTuple, Sequence

ATTENTION_KNEE_TOKENS = 4096  # context at which attention costs as much as the rest (approx.)


def prefill_cost(tokens: int, knee: int = ATTENTION_KNEE_TOKENS) -> float:
    """Relative prefill time of ``tokens`` tokens: linear work plus attention that grows with
    the position, ``tokens * (1 + tokens / (2 * knee))`` (unit: one token's linear work)."""
    return tokens * (1.0 + tokens / (2.0 * knee))


class EntryStats(NamedTuple):
    """What eviction needs of an entry: key, bytes, tokens held, last use (s); for a tail entry
    the tokens its parent holds for it (``base``) and the ``parent`` key (an entry with
    dependants is never evicted before them); ``on_device``: counted against the device budget.
    A named tuple: one per pool entry is made at every admission (a frozen dataclass's
    ``__init__`` costs several times more)."""

    key: Hashable
    nbytes: int
    tokens: int
    last_used: float
    base: int = 0
    parent: Hashable | None = None
    on_device: bool = False


@dataclass(frozen=True)
class EvictionPlan:
    """admit: whether the new entry is stored. evict: keys to drop, lowest value first."""

    admit: bool
    evict: list[Hashable]


def entry_values(entries: Sequence[EntryStats]) -> dict[Hashable, float]:
    """Value of each entry: prefill cost saved per byte / (1 + recency rank), rank 0 for the
    most recently used (entries used at the same time share a rank)."""
    times = sorted({e.last_used for e in entries}, reverse=True)
    rank = {t: i for i, t in enumerate(times)}
    return {e.key: (prefill_cost(e.tokens) - prefill_cost(e.base)) / max(1, e.nbytes)
            / (1 + rank[e.last_used]) for e in entries}


def plan_fit(entries: Sequence[EntryStats], budget_bytes: int, max_entries: int,
             protected: frozenset = frozenset(), device_budget_bytes: int = 0) -> list[Hashable] | None:
    """Keys to drop, lowest value first (:func:`entry_values`), so ``entries`` fit: host bytes
    (entries not ``on_device``) <= ``budget_bytes``, device bytes <= ``device_budget_bytes``,
    count <= ``max_entries``. Only leaves go (no remaining entry has them as ``parent``), and
    only ones that free what is over; protected keys never. None when no choice fits."""
    host = sum(e.nbytes for e in entries if not e.on_device)
    device = sum(e.nbytes for e in entries if e.on_device)
    if host <= budget_bytes and device <= device_budget_bytes and len(entries) <= max_entries:
        return []
    values = entry_values(entries)
    alive = {e.key: e for e in entries}
    children: dict[Hashable, int] = {}
    for e in entries:
        if e.parent in alive:
            children[e.parent] = children.get(e.parent, 0) + 1
    evict: list[Hashable] = []
    while host > budget_bytes or device > device_budget_bytes or len(alive) > max_entries:
        over_count = len(alive) > max_entries
        helps = [e for e in alive.values() if e.key not in protected and not children.get(e.key)
                 and (over_count or (e.on_device and device > device_budget_bytes)
                      or (not e.on_device and host > budget_bytes))]
        if not helps:
            return None
        gone = min(helps, key=lambda e: values[e.key])
        evict.append(gone.key)
        del alive[gone.key]
        if gone.parent in children:
            children[gone.parent] -= 1
        if gone.on_device:
            device -= gone.nbytes
        else:
            host -= gone.nbytes
    return evict


def plan_eviction(current: Sequence[EntryStats], new: EntryStats, budget_bytes: int,
                  max_entries: int, protected: frozenset = frozenset(),
                  device_budget_bytes: int = 0) -> EvictionPlan:
    """Which entries to drop so ``current + [new]`` fits (:func:`plan_fit`: the host budget
    ``budget_bytes``, the device budget for ``on_device`` entries, ``max_entries``).

    ``current`` is assumed to fit already. Entries go in increasing value
    (:func:`entry_values`); protected keys are never chosen, nor an entry another depends on.
    When the new entry itself would go (it is worth least, or cannot fit however many go), the
    plan is ``admit=False`` with nothing evicted: an entry is never stored only to be evicted
    at once.
    """
    limit = device_budget_bytes if new.on_device else budget_bytes
    if new.nbytes > limit or max_entries < 1:
        return EvictionPlan(False, [])
    evict = plan_fit([*current, new], budget_bytes, max_entries, protected, device_budget_bytes)
    if evict is None or new.key in evict:
        return EvictionPlan(False, [])
    return EvictionPlan(True, evict)
