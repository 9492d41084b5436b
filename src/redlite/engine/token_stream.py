"""The torch engine's :class:`~redlite.engine.base.TokenStream`: sampling inside the captured
decode step, ids read back one token behind the device.

Each :meth:`DeviceTokenStream.feed` replays the graph that feeds the token in the decoder's
token tensor and samples the next one into it (:meth:`GraphDecoder.step_ahead`), then queues
a copy of that id into a pinned host slot and records an event; :meth:`read` waits only for
the event of the oldest unread id. So while the host reads, detokenizes and scans token n,
the device already runs the step that feeds it.
"""

from __future__ import annotations

import collections
import weakref

import torch

from redlite.engine.base import EngineError, SamplingParams, TokenStream
from redlite.engine.device_sampling import SAMPLE

_SLOTS = 4  # unread ids at most: 2 (the one being read and the one sampled by the step ahead)
#: per decoder, its pinned host slots and their events: made once, reused by each stream
_READ_SLOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _read_slots(decoder) -> tuple[torch.Tensor, list]:
    """``decoder``'s host slots (int64 [_SLOTS], pinned on CUDA) and one event per slot (None
    off CUDA), made on its first stream. A later stream on the same decoder reuses them: its
    copies queue behind the earlier stream's on the one CUDA stream, so a slot is never read
    before the copy that stream made into it."""
    slots = _READ_SLOTS.get(decoder)
    if slots is None:
        pinned = decoder.device.type == "cuda"
        slots = (torch.zeros(_SLOTS, dtype=torch.long, pin_memory=pinned),
                 [torch.cuda.Event() if pinned else None for _ in range(_SLOTS)])
        _READ_SLOTS[decoder] = slots
    return slots


class DeviceTokenStream(TokenStream):
    """A stream over ``engine`` (a TorchEngine) and its ``decoder`` (a GraphDecoder), with
    ``mode`` ``greedy`` or ``sample``; samples the first token from ``logits`` ([vocab]
    float32 on the device) at once."""

    def __init__(self, engine, decoder, params: SamplingParams, mode: str, logits: torch.Tensor):
        self.engine, self.decoder, self.mode = engine, decoder, mode
        self._host, self._events = _read_slots(decoder)
        self._unread: collections.deque[int] = collections.deque()
        self._next_slot = 0
        self._fed_at: int | None = None  # where the last feed put its token (for undo)
        with torch.inference_mode():  # the decoder's tensors are inference tensors
            # greedy steps read no settings: no host-to-device copies for them
            self.seed = decoder.sampling.set(params) if mode == SAMPLE else None
            decoder.sample_first(logits, mode)
            self._queue_read()

    def _queue_read(self) -> None:
        slot = self._next_slot
        self._next_slot = (slot + 1) % _SLOTS
        if len(self._unread) >= _SLOTS:
            raise EngineError("token stream: too many unread tokens")
        self._host[slot:slot + 1].copy_(self.decoder.token, non_blocking=True)
        if self._events[slot] is not None:
            self._events[slot].record()
        self._unread.append(slot)

    def feed(self) -> None:
        state = self.engine.state
        position = state.n_past
        if position >= self.engine.max_context:
            raise EngineError(f"context overflow: ctx_size {self.engine.max_context} tokens held")
        with torch.inference_mode():
            self.decoder.step_ahead(position, self.mode)
            state.n_past = position + 1
            self._fed_at = position
            self._queue_read()

    def read(self) -> int:
        if not self._unread:
            raise EngineError("token stream: no token to read")
        slot = self._unread.popleft()
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        return int(self._host[slot])

    def undo(self) -> None:
        if self._fed_at is None:
            raise EngineError("token stream: nothing fed to undo")
        with torch.inference_mode():
            self.decoder.undo(self._fed_at)
        self._fed_at = None
