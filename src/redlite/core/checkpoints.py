"""Checkpoints of the held sequence for engines that cannot rewind (recurrent state).

Rules (issue "Hybrid Gated DeltaNet models ... and recurrent-state checkpoints"):
- taken at the end of every prompt prefill (a turn boundary), at each message boundary inside a
  prefilled prompt, and every ``interval`` tokens inside long prefills;
- bounded by ``budget_bytes``: when over, turn boundaries and the newest checkpoint are kept and
  the interior is thinned evenly.

The store is engine-agnostic: it keeps :class:`redlite.engine.base.Checkpoint` objects sorted by
position and decides which to drop; the engine takes and restores them.
"""

from __future__ import annotations

import bisect
from typing import Iterable

from redlite.engine.base import Checkpoint


def prefill_split_points(start: int, end: int, message_ends: Iterable[int], interval: int) -> list[int]:
    """Positions (tokens, ascending, each in ``(start, end]``) at which a prefill of tokens
    ``[start, end)`` is cut so a checkpoint can be taken; always ends with ``end``.

    message_ends: message boundary positions of the prompt. interval: checkpoint every
    ``interval`` absolute positions (0 disables).
    """
    points = {end}
    points.update(p for p in message_ends if start < p < end)
    if interval > 0:
        points.update(range((start // interval + 1) * interval, end, interval))
    return sorted(points)


class CheckpointStore:
    """Checkpoints of the held sequence, ascending by position, within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._items: list[Checkpoint] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def positions(self) -> list[int]:
        return [c.position for c in self._items]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._items)

    def items(self) -> list[Checkpoint]:
        return list(self._items)

    def clear(self) -> None:
        self._items.clear()

    def drop_after(self, position: int) -> None:
        """Forget checkpoints past ``position`` (the held sequence was cut there)."""
        del self._items[bisect.bisect_right(self.positions, position):]

    def get(self, position: int) -> Checkpoint | None:
        for checkpoint in self._items:
            if checkpoint.position == position:
                return checkpoint
        return None

    def add(self, checkpoint: Checkpoint) -> None:
        """Insert (replacing one at the same position), then thin to the budget."""
        self._items = [c for c in self._items if c.position != checkpoint.position]
        bisect.insort(self._items, checkpoint, key=lambda c: c.position)
        self._thin()

    def _thin(self) -> None:
        """Drop interior checkpoints evenly until within budget; keep turn boundaries and the
        newest. If turn boundaries alone exceed the budget, the oldest of them go."""
        while self.nbytes > self.budget_bytes and len(self._items) > 1:
            newest = self._items[-1]
            interior = [i for i, c in enumerate(self._items[:-1]) if not c.turn_boundary]
            if interior:
                # Remove the interior checkpoint whose neighbours are closest together, which
                # keeps the remaining ones evenly spread over the sequence.
                def gap(i: int) -> int:
                    left = self._items[i - 1].position if i > 0 else 0
                    right = self._items[i + 1].position
                    return right - left
                del self._items[min(interior, key=gap)]
            else:
                del self._items[0]
            assert self._items[-1] is newest
