"""Checkpoints of the held sequence for engines that cannot rewind (recurrent state).

Rules (issue "Hybrid Gated DeltaNet models ... and recurrent-state checkpoints"):
- taken at the end of every prompt prefill (a turn boundary), at each message boundary inside a
  prefilled prompt, and every ``interval`` tokens inside long prefills;
- bounded by ``budget_bytes``: when over, turn boundaries and the newest checkpoint are kept and
  the interior is thinned evenly;
- the checkpoint at the end of the leading system messages (system prompt + tools: the
  *preamble*, :func:`preamble_end`) is pinned: thinned last, so a new conversation with the same
  system prompt and tools restores it instead of prefilling it again.

The store is engine-agnostic: it keeps :class:`redlite.engine.base.Checkpoint` objects sorted by
position and decides which to drop; the engine takes and restores them.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

from redlite.engine.base import Checkpoint


def prefill_split_points(start: int, end: int, message_ends: Iterable[int], interval: int,
                         min_piece: int = 0, preamble: int | None = None) -> list[int]:
    """Positions (tokens, ascending, each in ``(start, end]``) at which a prefill of tokens
    ``[start, end)`` is cut so a checkpoint can be taken; always ends with ``end``.

    message_ends: message boundary positions of the prompt. interval: checkpoint every
    ``interval`` absolute positions (0 disables). min_piece: a cut closer than this to the
    previous cut (or ``start``) or to ``end`` is dropped: every piece is a forward pass whose
    fixed cost (its kernel launches, on a GPU) outweighs re-reading that few tokens from
    the neighbouring checkpoint later (a second turn's few new tokens stay one piece).
    preamble: the end of system + tools (:func:`preamble_end`), cut whatever ``min_piece``
    says: a new conversation with the same preamble restores it instead of reading it again.
    ``message_ends`` is not read when no cut of it could be kept (``end - start`` under twice
    ``min_piece``): it may be lazy (:class:`redlite.core.tokenizer.LazyPositions`), and a
    second turn's prefill need not wait for it.
    """
    if min_piece > 0 and end - start < 2 * min_piece:
        message_ends, interval = (), 0  # every cut would leave a piece under min_piece
    points = sorted({p for p in message_ends if start < p < end}
                    | (set(range((start // interval + 1) * interval, end, interval)) if interval > 0 else set())
                    | ({preamble} if preamble is not None and start < preamble < end else set()))
    kept, last = [], start
    for point in points:
        if point == preamble or (point - last >= min_piece and end - point >= min_piece
                                 and (preamble is None or not point < preamble < point + min_piece)):
            kept.append(point)
            last = point
    return kept + [end]


def preamble_end(message_ends: Sequence[int], roles: Sequence[str]) -> int | None:
    """Where the leading ``system`` / ``developer`` messages end (tokens), or None when the
    prompt opens with none or its boundaries are not aligned with its messages."""
    lead = 0
    while lead < len(roles) and roles[lead] in ("system", "developer"):
        lead += 1
    if not lead or len(message_ends) != len(roles):
        return None
    return message_ends[lead - 1]


class CheckpointStore:
    """Checkpoints of the held sequence, ascending by position, within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._items: list[Checkpoint] = []
        self._pinned: int | None = None  # position of the preamble checkpoint

    def __len__(self) -> int:
        return len(self._items)

    @property
    def positions(self) -> list[int]:
        return [c.position for c in self._items]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._items)

    @property
    def pinned(self) -> int | None:
        """Position of the pinned (preamble) checkpoint, or None."""
        return self._pinned

    def items(self) -> list[Checkpoint]:
        return list(self._items)

    def clear(self) -> None:
        self._items.clear()
        self._pinned = None

    def drop_after(self, position: int) -> None:
        """Forget checkpoints past ``position`` (the held sequence was cut there)."""
        del self._items[bisect.bisect_right(self.positions, position):]
        if self._pinned is not None and self._pinned > position:
            self._pinned = None

    def get(self, position: int) -> Checkpoint | None:
        for checkpoint in self._items:
            if checkpoint.position == position:
                return checkpoint
        return None

    def pin(self, position: int) -> None:
        """Pin the checkpoint at ``position`` (if any) as the preamble's."""
        if self.get(position) is not None:
            self._pinned = position

    def add(self, checkpoint: Checkpoint, pinned: bool = False) -> None:
        """Insert (replacing one at the same position), then thin to the budget. ``pinned``:
        the preamble checkpoint (one per store; thinned last)."""
        if pinned:
            self._pinned = checkpoint.position
        self._items = [c for c in self._items if c.position != checkpoint.position]
        bisect.insort(self._items, checkpoint, key=lambda c: c.position)
        self._thin()

    def _thin(self) -> None:
        """Drop interior checkpoints evenly until within budget; keep turn boundaries and the
        newest. If turn boundaries alone exceed the budget, the oldest of them go; the pinned
        one goes last (before the newest)."""
        while self.nbytes > self.budget_bytes and len(self._items) > 1:
            newest = self._items[-1]
            pinned = [i for i, c in enumerate(self._items[:-1]) if c.position == self._pinned]
            interior = [i for i, c in enumerate(self._items[:-1])
                        if not c.turn_boundary and c.position != self._pinned]
            if interior:
                # Remove the interior checkpoint whose neighbours are closest together, which
                # keeps the remaining ones evenly spread over the sequence.
                def gap(i: int) -> int:
                    left = self._items[i - 1].position if i > 0 else 0
                    right = self._items[i + 1].position
                    return right - left
                del self._items[min(interior, key=gap)]
            elif len(self._items) - len(pinned) > 1:
                del self._items[1 if pinned == [0] else 0]
            else:
                del self._items[pinned[0]]
                self._pinned = None
            assert self._items[-1] is newest
