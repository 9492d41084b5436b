"""Detached copies of an engine's held state: :class:`StateSnapshot` (whole or a token range)
and :class:`Checkpoint` (recurrent state at a position). No torch import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StateSnapshot:
    """A copy of an engine's held state, detached from the engine (host memory).

    n_past: tokens held (int). tensors: name -> array (``torch.Tensor`` on CPU for the torch
    engine, ``numpy.ndarray`` for the echo engine); ``tensor_format`` says which, so the disk
    tier can pick ``safetensors.torch`` or ``safetensors.numpy``. meta: JSON-serialisable
    extras (layout, checkpoint positions). nbytes: total tensor bytes, summed once (the pool
    reads it for every entry on every admission) and again only after ``tensors`` is assigned:
    the dict is replaced, never changed in place.
    """

    n_past: int
    tensors: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    tensor_format: str = "torch"

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "tensors":
            object.__setattr__(self, "_nbytes", None)
        object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            total = 0
            for array in self.tensors.values():
                if hasattr(array, "nbytes"):
                    total += int(array.nbytes)
                else:
                    total += int(array.numel() * array.element_size())
            object.__setattr__(self, "_nbytes", total)
        return self._nbytes


def range_of(snapshot: StateSnapshot) -> tuple[int, int]:
    """``(start, stop)`` tokens a snapshot covers: ``meta["range"]`` of a
    :meth:`Engine.snapshot_range` copy, ``(0, n_past)`` for a whole :meth:`Engine.snapshot`."""
    extent = snapshot.meta.get("range")
    if extent is None:
        return 0, int(snapshot.n_past)
    return int(extent[0]), int(extent[1])


def has_end_state(snapshot: StateSnapshot) -> bool:
    """Whether a snapshot carries the state at its end (a whole snapshot always does)."""
    return bool(snapshot.meta.get("end_state", True))


@dataclass
class Checkpoint:
    """Recurrent part of the state at ``position`` tokens, plus the logits there.

    Restoring it and truncating attention KV caches to ``position`` rolls the whole model back
    exactly (see the hybrid-model issue). ``data`` is engine-specific; ``nbytes`` its size.
    """

    position: int
    logits: Any
    data: Any
    nbytes: int
    turn_boundary: bool = False
