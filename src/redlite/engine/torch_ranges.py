"""Token ranges of a :class:`~redlite.engine.torch_engine.TorchEngine`'s held state (see
:meth:`Engine.snapshot_range`): ``"kv"`` ``[layers, 2, Hkv, stop - start, D]`` of the state's KV
cache, plus the recurrent tensors (``export_recurrent`` names) at the end."""

from __future__ import annotations

import torch

from redlite.engine.base import EngineError, StateSnapshot, has_end_state, range_of


class TorchRanges:
    """Mixin of :class:`~redlite.engine.torch_engine.TorchEngine`: the token-range methods of
    :class:`~redlite.engine.base.Engine`. Uses the engine's ``state`` (with a ``cache``),
    ``device``, ``dtype``, ``n_past``, ``max_context`` and ``fingerprint()``."""

    def _recurrent(self, device) -> dict[str, torch.Tensor]:
        export = getattr(self.state, "export_recurrent", None)
        return dict(export(device)) if export is not None else {}

    def range_nbytes(self, start: int, stop: int | None = None) -> int:
        stop = self.n_past if stop is None else int(stop)
        recurrent = getattr(self.state, "recurrent_nbytes", None)
        end = recurrent() if recurrent is not None and stop == self.n_past else 0
        return int(self.state.cache.nbytes(stop - start)) + int(end)

    def _meta(self, start: int, stop: int, end_state: bool) -> dict:
        # no fingerprint: hashing the weights would cost the first fork seconds on a big model;
        # ranges stay in this process (files carry the store's fingerprint)
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "layout": type(self.state).__name__, "range": [int(start), int(stop)],
                "end_state": bool(end_state)}

    def snapshot_range(self, start: int, stop: int | None = None,
                       on_device: bool = False) -> StateSnapshot:
        n = self.n_past
        stop = n if stop is None else int(stop)
        if not 0 <= start <= stop <= n:
            raise EngineError(f"range [{start}, {stop}) of {n} held tokens")
        target = self.device if on_device else torch.device("cpu")
        with torch.no_grad():
            part = self.state.cache.data[:, :, :, start:stop]
            if target == self.device:
                kv = part.clone(memory_format=torch.contiguous_format)
            else:
                kv = part.contiguous().to(target)
            tensors = {"kv": kv}
            if stop == n:
                tensors.update(self._recurrent(target))
        return StateSnapshot(stop, tensors, self._meta(start, stop, stop == n), tensor_format="torch")

    def restore_range(self, snapshot: StateSnapshot) -> None:
        start, stop = range_of(snapshot)
        found = snapshot.meta.get("fingerprint")
        if found is not None and found != self.fingerprint():
            raise EngineError("range was taken from another model")
        if not 0 <= start <= self.n_past or stop > self.max_context:
            raise EngineError(f"range [{start}, {stop}) does not fit {self.n_past} held tokens")
        data = self.state.cache.data
        kv = snapshot.tensors.get("kv")
        expected = tuple(data.shape[:3]) + (stop - start,) + tuple(data.shape[4:])
        if kv is None or tuple(kv.shape) != expected:
            raise EngineError(f"range KV shape {None if kv is None else tuple(kv.shape)} != {expected}")
        recurrent = {name: t for name, t in snapshot.tensors.items() if name != "kv"}
        with torch.inference_mode():
            data[:, :, :, start:stop].copy_(kv)
            self.state.n_past = int(stop)  # the KV rows [0, stop) are valid now
            if has_end_state(snapshot) and hasattr(self.state, "import_recurrent"):
                self.state.import_recurrent(recurrent, int(stop))

    def slice_range(self, snapshot: StateSnapshot, start: int, stop: int) -> StateSnapshot:
        first, last = range_of(snapshot)
        if not first <= start <= stop <= last:
            raise EngineError(f"[{start}, {stop}) is not inside [{first}, {last})")
        end = stop == last and has_end_state(snapshot)
        tensors = {"kv": snapshot.tensors["kv"][:, :, :, start - first:stop - first]}
        if end:
            tensors.update((k, v) for k, v in snapshot.tensors.items() if k != "kv")
        return StateSnapshot(stop, tensors, self._meta(start, stop, end), tensor_format="torch")

    def join_ranges(self, pieces, on_device: bool = False) -> StateSnapshot:
        extents = [range_of(p) for p in pieces]
        if not extents or any(a[1] != b[0] for a, b in zip(extents, extents[1:])):
            raise EngineError(f"ranges {extents} are not adjacent")
        target = self.device if on_device else torch.device("cpu")
        last = pieces[-1]
        with torch.no_grad():
            kv = torch.cat([p.tensors["kv"].to(target) for p in pieces], dim=3)
            tensors = {"kv": kv}
            if has_end_state(last):  # one storage per name (safetensors refuses shared ones)
                tensors.update((k, v.to(target, copy=True).contiguous())
                               for k, v in last.tensors.items() if k != "kv")
        start, stop = extents[0][0], extents[-1][1]
        return StateSnapshot(stop, tensors, self._meta(start, stop, has_end_state(last)),
                             tensor_format="torch")
