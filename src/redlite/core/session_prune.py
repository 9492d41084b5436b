"""Which session files to delete (pure): rejected ones first, then the least recently used,
until the ``--session-keep`` / ``--session-max-gb`` bounds hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class FileStats:
    key: Hashable
    nbytes: int
    last_used: float
    rejected: bool = False


def plan_prune(files: Sequence[FileStats], keep: int, max_bytes: int,
               protected: frozenset = frozenset()) -> list[Hashable]:
    """Keys of the files to delete, rejected ones first, then least recently used first, so
    that at most ``keep`` files and ``max_bytes`` bytes remain; protected keys are never
    chosen (the result may then still exceed the bounds)."""
    order = sorted(files, key=lambda f: (not f.rejected, f.last_used))
    count, total = len(files), sum(f.nbytes for f in files)
    victims = []
    for f in order:
        if count <= keep and total <= max_bytes:
            break
        if f.key in protected:
            continue
        victims.append(f.key)
        count, total = count - 1, total - f.nbytes
    return victims
