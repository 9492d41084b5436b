"""Token ranges and checkpoints of the echo engine: ranges are ``{"held": int64 [stop - start]}``
with the source (the "recurrent" part) as the end state; checkpoints hold the source and the
answer position."""

from __future__ import annotations

import time

import numpy as np

from redlite.engine.base import Checkpoint, EngineError, StateSnapshot, has_end_state, range_of
from redlite.engine.echo_sampling import EchoLogits


class EchoRanges:
    """Mixin of :class:`~redlite.engine.echo.EchoEngine`: the token-range and checkpoint methods
    of :class:`~redlite.engine.base.Engine`, over the engine's ``_held``, ``_source`` and
    ``_generated``."""

    def range_nbytes(self, start: int, stop: int | None = None) -> int:
        stop = self.n_past if stop is None else stop
        return 8 * (stop - start)

    def snapshot_range(self, start: int, stop: int | None = None,
                       on_device: bool = False) -> StateSnapshot:
        stop = self.n_past if stop is None else int(stop)
        if not 0 <= start <= stop <= self.n_past:
            raise EngineError(f"range [{start}, {stop}) of {self.n_past} held tokens")
        if self.snapshot_delay_ms:
            time.sleep(self.snapshot_delay_ms * (stop - start) / max(1, self.n_past) / 1000.0)
        meta = {"range": [int(start), stop], "end_state": stop == self.n_past}
        if meta["end_state"]:
            meta.update(source=self._source.hex(), generated=self._generated)
        return StateSnapshot(stop, {"held": np.asarray(self._held[start:stop], dtype=np.int64)},
                             meta, tensor_format="numpy")

    def restore_range(self, snapshot: StateSnapshot) -> None:
        start, stop = range_of(snapshot)
        held = snapshot.tensors["held"]
        if start > self.n_past or len(held) != stop - start or stop > self.max_context:
            raise EngineError(f"range [{start}, {stop}) does not fit {self.n_past} held tokens")
        del self._held[start:]
        self._held.extend(int(t) for t in held)
        if has_end_state(snapshot):
            self._source = bytes.fromhex(snapshot.meta.get("source", ""))
            self._generated = int(snapshot.meta.get("generated", 0))

    def slice_range(self, snapshot: StateSnapshot, start: int, stop: int) -> StateSnapshot:
        first, last = range_of(snapshot)
        if not first <= start <= stop <= last:
            raise EngineError(f"[{start}, {stop}) is not inside [{first}, {last})")
        meta = {"range": [start, stop], "end_state": stop == last and has_end_state(snapshot)}
        if meta["end_state"]:
            meta.update(source=snapshot.meta.get("source", ""), generated=snapshot.meta.get("generated", 0))
        held = snapshot.tensors["held"][start - first:stop - first]
        return StateSnapshot(stop, {"held": held}, meta, tensor_format="numpy")

    def join_ranges(self, pieces, on_device: bool = False) -> StateSnapshot:
        extents = [range_of(p) for p in pieces]
        if not extents or any(a[1] != b[0] for a, b in zip(extents, extents[1:])):
            raise EngineError(f"ranges {extents} are not adjacent")
        start, stop = extents[0][0], extents[-1][1]
        last = pieces[-1]
        meta = {"range": [start, stop], "end_state": has_end_state(last)}
        if meta["end_state"]:
            meta.update(source=last.meta.get("source", ""), generated=last.meta.get("generated", 0))
        held = np.concatenate([np.asarray(p.tensors["held"], dtype=np.int64) for p in pieces])
        return StateSnapshot(stop, {"held": held}, meta, tensor_format="numpy")

    def take_checkpoint(self, logits: EchoLogits, turn_boundary: bool = False) -> Checkpoint | None:
        if self.can_rewind:
            return None
        data = (self._source, self._generated)
        return Checkpoint(self.n_past, logits, data, nbytes=64 + len(self._source),
                          turn_boundary=turn_boundary)

    def restore_checkpoint(self, checkpoint: Checkpoint) -> EchoLogits:
        if checkpoint.position > self.n_past:
            raise EngineError(f"checkpoint at {checkpoint.position} is past the held {self.n_past} tokens")
        del self._held[checkpoint.position:]
        self._source, self._generated = checkpoint.data
        return checkpoint.logits

    def checkpoint_to_tensors(self, checkpoint: Checkpoint) -> tuple[dict, dict]:
        """``({"logits": int64 [1]}, {"source": hex, "generated": int})``."""
        source, generated = checkpoint.data
        logits = np.asarray([checkpoint.logits.next_token], dtype=np.int64)
        return {"logits": logits}, {"source": source.hex(), "generated": int(generated)}

    def checkpoint_from_tensors(self, position: int, tensors: dict, meta: dict,
                                turn_boundary: bool = False) -> Checkpoint:
        try:
            source = bytes.fromhex(meta["source"])
            data = (source, int(meta["generated"]))
            logits = EchoLogits(int(np.asarray(tensors["logits"]).reshape(-1)[0]), b"", self.vocab_size)
        except (KeyError, ValueError, TypeError, IndexError) as error:
            raise EngineError(f"bad echo checkpoint: {error}") from None
        return Checkpoint(int(position), logits, data, nbytes=64 + len(source),
                          turn_boundary=turn_boundary)
