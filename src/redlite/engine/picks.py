"""Greedy picks that stay on the engine's device until the host needs them.

A batch step's greedy tokens can feed the next batch step without a trip through the host:
:meth:`Engine.greedy_batch_async <redlite.engine.base.Engine.greedy_batch_async>` returns a
:class:`PickHandle` at once (on a GPU the argmax and its copy to host memory are queued
behind the step) and marks each slot with its pick; a later
:meth:`~redlite.engine.base.Engine.decode_batch` may then be given :data:`PICKED` for such a
slot, meaning "the token picked for this slot after its last step", and an engine on a device
feeds it from device memory, so the next step can be queued before the first has finished.
The host reads the ids through :meth:`PickHandle.ids` (waits for the step once).

This module must not import torch (the core uses it with the echo engine).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from redlite.engine.errors import EngineError

PICKED = -1  # a decode_batch token: "this slot's pending greedy pick" (see the module docstring)


class PickHandle:
    """The greedy ids of one batch step's rows: ``ids`` already on the host, or ``read`` (a
    callable returning them, waiting for the device; engines on a device pass it). Thread-safe:
    the first :meth:`ids` call reads, later ones return the same list."""

    def __init__(self, ids: Sequence[int] | None = None, read: Callable[[], Sequence[int]] | None = None) -> None:
        if (ids is None) == (read is None):
            raise ValueError("a PickHandle takes ids or read, one of them")
        self._ids = None if ids is None else [int(i) for i in ids]
        self._read = read
        self._lock = threading.Lock()

    def ids(self) -> list[int]:
        """The picked ids, in the rows' order (blocks until the device has them)."""
        if self._ids is None:
            with self._lock:
                if self._ids is None:
                    self._ids = [int(i) for i in self._read()]
        return self._ids


def mark_picks(slots: Sequence[Any], handle: PickHandle) -> PickHandle:
    """Record ``handle`` row j as ``slots[j]``'s pending pick (the attribute
    ``pending_pick``, read by :func:`resolve_picks` and the engines' ``decode_batch``)."""
    for row, slot in enumerate(slots):
        slot.pending_pick = (handle, row)
    return handle


def pick_of(slot: Any) -> tuple[PickHandle, int]:
    """``slot``'s pending pick (handle, row); :class:`EngineError` when it has none."""
    pick = getattr(slot, "pending_pick", None)
    if pick is None:
        raise EngineError("decode_batch got PICKED for a slot with no pending pick")
    return pick


def resolve_picks(slots: Sequence[Any], token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` with every :data:`PICKED` replaced by the slot's picked id (waiting for it:
    the path of engines that feed host ids)."""
    out = []
    for slot, token in zip(slots, token_ids):
        if int(token) == PICKED:
            handle, row = pick_of(slot)
            token = handle.ids()[row]
        out.append(int(token))
    return out
