"""Parked conversations <-> session files: the metadata and tensors of a
:class:`~redlite.core.parking.ParkedEntry` for :func:`redlite.core.session_file.write_state_file`,
and back from a read file; what an engine's files must match (:func:`expected_for`)."""

from __future__ import annotations

from typing import Any, Hashable

from redlite.core.parking import ParkedCheckpoint, ParkedEntry, tensor_nbytes
from redlite.core.replay import GeneratedTurn
from redlite.core.session_file import Expected, SessionFileError, StateFile
from redlite.engine.base import StateSnapshot


def engine_dtype(engine: Any) -> str:
    """The compute dtype an engine names in its files (``"none"`` for the echo engine), with
    ``"+kv-<dtype>"`` when its KV cache holds another dtype (``engine.kv_dtype``): a state
    computed with another cache dtype is not what this engine computes, so such files are
    refused like those of another dtype."""
    dtype = str(getattr(engine, "dtype", "none")).removeprefix("torch.")
    kv = str(getattr(engine, "kv_dtype", dtype)).removeprefix("torch.")
    return dtype if kv == dtype else f"{dtype}+kv-{kv}"


def expected_for(engine: Any) -> Expected:
    """What this engine's files carry. Probes ``engine.snapshot()`` for its tensor format, so
    call it while the engine holds no conversation (at start)."""
    return Expected(engine.fingerprint(), engine_dtype(engine), engine.snapshot().tensor_format)


def entry_to_file(entry: ParkedEntry, expected: Expected) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, tensors) of ``entry`` for :func:`write_state_file`. Checkpoints held only as
    engine objects (no host form) are left out."""
    snapshot = entry.snapshot
    tensors = {f"state.{name}": array for name, array in snapshot.tensors.items()}
    checkpoints = []
    for i, c in enumerate(c for c in entry.checkpoints if c.tensors is not None):
        names = []
        for name, array in c.tensors.items():
            tensors[f"ckpt.{i}.{name}"] = array
            names.append(name)
        checkpoints.append({"position": c.position, "turn_boundary": c.turn_boundary,
                            "nbytes": c.nbytes, "meta": c.meta or {}, "tensors": names})
    meta = {"fingerprint": expected.fingerprint, "dtype": expected.dtype,
            "tensor_format": snapshot.tensor_format,
            "layout": str(snapshot.meta.get("layout", "")), "n_past": snapshot.n_past,
            "held_ids": [int(t) for t in entry.held_ids], "engine_meta": snapshot.meta,
            "checkpoints": checkpoints, "created": entry.created, "last_used": entry.last_used,
            "session": entry.session, "replay": [t.to_record() for t in entry.replay]}
    return meta, tensors


def entry_from_file(state: StateFile, key: Hashable) -> ParkedEntry:
    """The :class:`ParkedEntry` (tier ``disk``) in a verified file. Raises SessionFileError
    ("corrupt-header") when the metadata are inconsistent."""
    meta = state.meta
    try:
        held = [int(t) for t in meta["held_ids"]]
        n_past = int(meta["n_past"])
        if n_past != len(held):
            raise ValueError(f"n_past {n_past} != {len(held)} held ids")
        snapshot = StateSnapshot(n_past, {name[6:]: array for name, array in state.tensors.items()
                                          if name.startswith("state.")},
                                 dict(meta.get("engine_meta") or {}), meta["tensor_format"])
        checkpoints = []
        for i, c in enumerate(meta.get("checkpoints") or []):
            payload = {name: state.tensors[f"ckpt.{i}.{name}"] for name in c["tensors"]}
            checkpoints.append(ParkedCheckpoint(int(c["position"]), bool(c["turn_boundary"]),
                                                tensor_nbytes(payload), payload, dict(c["meta"])))
        replay = [GeneratedTurn.from_record(r) for r in meta.get("replay") or []]
    except (KeyError, ValueError, TypeError) as error:
        raise SessionFileError("corrupt-header", f"inconsistent metadata: {error}") from None
    return ParkedEntry(key, held, snapshot, checkpoints, float(meta.get("created", 0.0)),
                       float(meta.get("last_used", 0.0)), tier="disk",
                       session=meta.get("session"), replay=replay)
