"""Parked conversations: the entry, the candidate choice (pure), and the pool (device and host
memory; its eviction plans are :mod:`redlite.core.eviction`).

Rules (issue "Conversation parking: RAM pool, disk sessions, slot API, restarts"):

- A request takes the best candidate among the live state and every parked one: the one whose
  *usable* common prefix with the prompt is longest (:func:`usable_prefix`: the whole common
  prefix for an engine that can rewind, else up to the newest checkpoint at or below it).
  Ties go to the live state (nothing to restore), then to another slot's live state (a copy
  on the device, ``--parallel``), then to the device, then RAM, then disk, then to the most
  recently used (:func:`choose_candidate`).
- The pool admits and evicts by :func:`redlite.core.eviction.plan_eviction`.

The decisions are pure functions of plain data; :class:`ParkingPool` keeps the entries and a
:class:`~redlite.core.prefix_index.PrefixIndex` so a lookup compares tokens only with the few
entries sharing the prompt's leading blocks, given the hashes of the blocks the prompt shares
with the live state (:meth:`redlite.core.sequence.Sequence.held_hashes`): its cost follows what
the prompt adds, not the conversation's length.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from redlite.core.eviction import EntryStats, EvictionPlan, plan_eviction
from redlite.core.prefix_index import DEFAULT_BLOCK, PrefixIndex
from redlite.core.reuse import common_prefix_length
from redlite.engine.base import StateSnapshot

LIVE = "live"
POOL_TIERS = ("device", "ram")  # a pool entry's tier: its state in device memory, or in host RAM
ID_BYTES_PER_TOKEN = 8  # held ids are accounted at 8 bytes per token


def tensor_nbytes(tensors: dict[str, Any]) -> int:
    """Total bytes of a name -> array dict (numpy arrays or torch tensors)."""
    return StateSnapshot(0, tensors).nbytes


@dataclass
class ParkedCheckpoint:
    """A checkpoint of a parked conversation, in host form when the engine supports it
    (``tensors`` + ``meta`` from ``Engine.checkpoint_to_tensors``), else the engine's own
    :class:`~redlite.engine.base.Checkpoint` object in ``obj`` (kept in RAM only).
    position: tokens. nbytes: payload bytes."""

    position: int
    turn_boundary: bool
    nbytes: int
    tensors: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    obj: Any = None


@dataclass
class ParkedEntry:
    """One conversation moved out of the engine.

    key: unique id. held_ids: the token ids the state holds (len == ``snapshot.n_past``).
    snapshot: the engine state in host memory (None for a disk entry not loaded yet).
    checkpoints: the conversation's checkpoints, ascending by position.
    created/last_used: wall-clock times (s since the epoch). tier: ``"device"`` or ``"ram"`` (in
    the pool, by ``on_device``) or ``"disk"``.
    fill/verify: for an entry just read from disk (its tensors mapped, unverified):
    ``fill(engine) -> bool`` reads the file straight into the engine's memory and verifies it
    (True; raises when the file is refused) or, for an engine offering no targets, starts the
    checksum pass and returns False; ``verify() -> None`` finishes that pass (raises when the
    file is refused). ``install`` calls both before trusting the state.
    """

    key: Hashable
    held_ids: list[int]
    snapshot: StateSnapshot | None
    checkpoints: list[ParkedCheckpoint] = field(default_factory=list)
    created: float = 0.0
    last_used: float = 0.0
    tier: str = "ram"
    fill: Callable[[Any], bool] | None = None
    verify: Callable[[], None] | None = None
    session: str | None = None  # the client's session key of the conversation (saved with it)
    # the exact-replay turns (redlite.core.replay.GeneratedTurn) its held ids hold (saved with it)
    replay: list = field(default_factory=list)
    hits: int = 0  # requests that reused this conversation's state (not saved with it)
    # A tail entry (see redlite.core.forks): ``snapshot`` holds only tokens [base, len(held_ids))
    # (plus the end state), ``checkpoints`` only those past ``base``; the prefix [0, base) is the
    # state of ``parent``: LIVE (the live conversation) or the key of another pool entry.
    base: int = 0
    parent: Hashable | None = None
    on_device: bool = False  # the snapshot stays in the engine's device memory

    @property
    def checkpoint_positions(self) -> list[int]:
        return [c.position for c in self.checkpoints]

    @property
    def is_tail(self) -> bool:
        return self.parent is not None

    @property
    def nbytes(self) -> int:
        """Host bytes: state tensors + checkpoints + held ids (8 bytes per token)."""
        state = self.snapshot.nbytes if self.snapshot is not None else 0
        checkpoints = sum(c.nbytes for c in self.checkpoints)
        return state + checkpoints + ID_BYTES_PER_TOKEN * len(self.held_ids)


# --- candidate choice (pure) -------------------------------------------------------------------

def usable_prefix(held_len: int, common: int, prompt_len: int, can_rewind: bool,
                  checkpoint_positions: Sequence[int] = ()) -> int:
    """Tokens of a held state a prompt can keep (the ``keep`` of
    :func:`redlite.core.reuse.plan_reuse` for that state; every quantity in tokens).

    common: common prefix length of the held ids and the prompt. A state the prompt extends is
    kept whole; otherwise a rewindable state keeps ``min(common, prompt_len - 1)`` and one that
    cannot rewind keeps its newest checkpoint ``<= min(common, prompt_len)`` (0 when none).
    """
    if held_len == 0 or common == 0:
        return 0
    if common == held_len and held_len < prompt_len:
        return held_len
    if can_rewind:
        return min(common, prompt_len - 1)
    bound = min(common, prompt_len)
    return max((p for p in checkpoint_positions if 0 < p <= bound), default=0)


def longest_usable(prompt_len: int, can_rewind: bool) -> int:
    """The longest :func:`usable_prefix` any state can have for a prompt of ``prompt_len``."""
    return prompt_len - 1 if can_rewind else prompt_len


@dataclass(frozen=True)
class Candidate:
    """A state a request could start from. key: ``LIVE``, a parked entry's key, or another
    slot's. usable: its :func:`usable_prefix` for the prompt (tokens). tier: ``live``,
    ``slot`` (another slot's live state), ``device``, ``ram`` or ``disk``. held_len: tokens
    the state holds. session: the state belongs to the request's session key.
    """

    key: Hashable
    usable: int
    tier: str
    last_used: float = 0.0
    held_len: int = 0
    session: bool = False
    common: int | None = None  # its held ids' common prefix with the prompt, where compared


_TIER_ORDER = {"live": 0, "slot": 1, "device": 2, "ram": 3, "disk": 4}
RESTORE_MIN_TOKENS = 128


def worth_restoring(candidate: Candidate) -> bool:
    """Whether a parked candidate saves enough for what its restore reads: at least
    ``RESTORE_MIN_TOKENS`` usable tokens or at least half the tokens it holds (a restore reads
    them all: a 54k-token conversation from disk for the one token "hi" shares with it costs
    100 ms on a CPU and seconds on a GPU, a one-token prefill almost nothing). The live state
    and other slots are always worth it (nothing is read)."""
    if candidate.tier in ("live", "slot"):
        return True
    return candidate.usable >= RESTORE_MIN_TOKENS or 2 * candidate.usable >= candidate.held_len


def choose_candidate(candidates: Sequence[Candidate]) -> Candidate | None:
    """The candidate with the longest usable prefix among those :func:`worth_restoring`; ties:
    the request's session's, then live, then another slot's, then device, then RAM, then disk,
    then the most recently used. None when no candidate has a usable prefix > 0."""
    usable = [c for c in candidates if c.usable > 0 and worth_restoring(c)]
    if not usable:
        return None
    return min(usable, key=lambda c: (-c.usable, not c.session, _TIER_ORDER.get(c.tier, 4),
                                      -c.last_used))


# --- the pool ----------------------------------------------------------------------------------

class ParkingPool:
    """Parked entries within ``budget_bytes`` (host memory), ``device_budget_bytes`` (entries
    ``on_device``) and ``max_entries``.

    Not thread-safe: used from the engine worker thread only.
    """

    def __init__(self, budget_bytes: int, max_entries: int, block: int = DEFAULT_BLOCK,
                 device_budget_bytes: int = 0) -> None:
        self.budget_bytes = int(budget_bytes)
        self.device_budget_bytes = int(device_budget_bytes)  # --park-device-mib
        self.max_entries = int(max_entries)
        self._entries: dict[Hashable, ParkedEntry] = {}
        self._index = PrefixIndex(block)
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes of every entry (host and device)."""
        return sum(e.nbytes for e in self._entries.values())

    @property
    def host_nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if not e.on_device)

    @property
    def device_nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.on_device)

    def children(self, parent: Hashable) -> list[ParkedEntry]:
        """Entries whose prefix is ``parent``'s state (``LIVE`` or a key)."""
        return [e for e in self._entries.values() if e.parent == parent]

    def entries(self) -> list[ParkedEntry]:
        return list(self._entries.values())

    def new_key(self) -> str:
        return f"parked-{next(self._ids)}"

    def stats(self, entry: ParkedEntry) -> EntryStats:
        return EntryStats(entry.key, entry.nbytes, len(entry.held_ids), entry.last_used,
                          entry.base, entry.parent, entry.on_device)

    @property
    def block(self) -> int:
        """The prefix index's block (tokens): what :meth:`hashes` hashes."""
        return self._index.block

    def candidates(self, prompt: Sequence[int], can_rewind: bool, best_so_far: int = 0,
                   live_common: int | None = None, known: Sequence[bytes] = ()) -> list[Candidate]:
        """Entries worth considering for ``prompt`` with their usable prefix (verified by token
        comparison); shallower index groups are skipped once they cannot beat the best.
        live_common: see :func:`entry_fit`; known: leading :meth:`hashes` of ``prompt``."""
        return candidates_from_index(self._index, self._entries, prompt, can_rewind, best_so_far,
                                     live_common, known)

    def plan_admission(self, entry: ParkedEntry, protected: frozenset = frozenset()) -> EvictionPlan:
        current = [self.stats(e) for e in self._entries.values()]
        return plan_eviction(current, self.stats(entry), self.budget_bytes, self.max_entries,
                             protected, self.device_budget_bytes)

    def hashes(self, ids: Sequence[int]) -> list[bytes]:
        """The index's hashes of ``ids``, computed once for :meth:`prefixes_of` and :meth:`add`."""
        return self._index.hashes(ids)

    def hashes_of(self, key: Hashable) -> list[bytes]:
        """The index's hashes of entry ``key``'s held ids (empty when absent)."""
        return self._index.hashes_of(key)

    def add(self, entry: ParkedEntry, hashes: list[bytes] | None = None) -> None:
        """Store ``entry`` (the caller has applied :meth:`plan_admission`); its tier is
        ``device`` or ``ram`` by where its state is. hashes: :meth:`hashes` of its held ids."""
        entry.tier = "device" if entry.on_device else "ram"
        self._entries[entry.key] = entry
        self._index.add(entry.key, entry.held_ids, hashes)

    def get(self, key: Hashable) -> ParkedEntry:
        """The entry (it stays in the pool). Raises KeyError when absent."""
        return self._entries[key]

    def pop(self, key: Hashable) -> ParkedEntry:
        """Remove and return an entry. Raises KeyError when absent."""
        entry = self._entries.pop(key)
        self._index.remove(key)
        return entry

    def prefixes_of(self, ids: Sequence[int], hashes: list[bytes] | None = None,
                    live: bool = False) -> list[Hashable]:
        """Keys of entries whose held ids are a prefix of ``ids`` (superseded by them), leaves
        only (an entry others depend on stays). hashes: :meth:`hashes` of ``ids``. live: ``ids``
        are the live state's held ids, which an entry on the live state (parent ``LIVE``)
        holds up to its ``base`` (:mod:`redlite.core.forks`): only its ids past that compared."""
        parents = {e.parent for e in self._entries.values()}
        out = []
        for group in self._index.lookup(ids, hashes or ()):
            for key in group.keys:
                if key in parents:
                    continue
                entry = self._entries[key]
                held, n = entry.held_ids, len(entry.held_ids)
                start = entry.base if live and entry.parent == LIVE else 0
                last = max(start, n - 64)
                # its last ids first: a branch that differs near its end is told apart at once
                if n <= len(ids) and held[last:] == ids[last:n] and held[start:last] == ids[start:last]:
                    out.append(key)
        return out


def candidates_from_index(index: PrefixIndex, entries: dict, prompt: Sequence[int],
                          can_rewind: bool, best_so_far: int = 0,
                          live_common: int | None = None, known: Sequence[bytes] = ()) -> list[Candidate]:
    """Verify the index's groups for ``prompt``, deepest first, and return the entries with a
    usable prefix > 0. Stops when a group's entries cannot reach the best usable prefix found,
    nor beat ``best_so_far``: the usable prefix of a candidate that wins ties against them
    (the live state's, say). ``entries`` maps key -> object with ``held_ids``,
    ``checkpoint_positions``, ``tier`` and ``last_used``. live_common: see :func:`entry_fit`;
    known: leading chain hashes of ``prompt`` (:meth:`PrefixIndex.lookup`)."""
    found: list[Candidate] = []
    best = best_so_far
    most = longest_usable(len(prompt), can_rewind)
    for group in index.lookup(prompt, known):
        reach = min(group.bound - 1, most)
        if reach < best or reach <= best_so_far:
            break
        for key in group.keys:
            entry = entries[key]
            common, usable = entry_fit(entry, prompt, can_rewind, live_common)
            if usable > 0:
                found.append(Candidate(key, usable, entry.tier, entry.last_used, len(entry.held_ids),
                                       common=common))
                best = max(best, usable)
    return found


def entry_fit(entry: Any, prompt: Sequence[int], can_rewind: bool,
              live_common: int | None = None) -> tuple[int, int]:
    """(common, usable): the common prefix of a parked entry's held ids and ``prompt``, and its
    :func:`usable_prefix`; usable is 0 for a tail entry at or below its base (its parent serves
    as well there). live_common: the common prefix of the trusted live state's held ids and
    ``prompt``, when known: a tail entry on the live state holds its first ``base`` ids
    (:mod:`redlite.core.forks`), so only its tail is compared."""
    held = entry.held_ids
    if live_common is not None and getattr(entry, "parent", None) == LIVE:
        common = live_common if entry.base > live_common else \
            common_prefix_length(held, prompt, start=entry.base)
    else:
        common = common_prefix_length(held, prompt)
    usable = usable_prefix(len(held), common, len(prompt), can_rewind, entry.checkpoint_positions)
    if getattr(entry, "parent", None) is not None and usable <= getattr(entry, "base", 0):
        return common, 0
    return common, usable
