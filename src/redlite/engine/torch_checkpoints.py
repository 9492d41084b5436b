"""Checkpoints of a :class:`~redlite.engine.torch_engine.TorchEngine` whose state has recurrent
parts (``can_truncate`` False)."""

from __future__ import annotations

from typing import Any

import torch

from redlite.engine.base import Checkpoint, EngineError


class TorchCheckpoints:
    """Mixin of :class:`~redlite.engine.torch_engine.TorchEngine`: the checkpoint methods of
    :class:`~redlite.engine.base.Engine`.

    Such a state provides ``export_recurrent(device) -> dict[str, Tensor]`` (the recurrent
    part at ``n_past``) and ``import_recurrent(tensors, position)`` (roll back to
    ``position``: recurrent part copied in, KV caches cut), as ``Qwen3_5State`` does.
    """

    def take_checkpoint(self, logits: torch.Tensor, turn_boundary: bool = False) -> Checkpoint | None:
        """Checkpoint at ``n_past`` holding device copies of the recurrent state and of
        ``logits`` ([vocab] float32). None for rewindable states (they need none)."""
        if self.can_rewind:
            return None
        with torch.no_grad():
            data = self.state.export_recurrent()
            logits = logits.clone()
        nbytes = sum(_nbytes(t) for t in data.values()) + _nbytes(logits)
        return Checkpoint(position=self.n_past, logits=logits, data=data, nbytes=nbytes,
                          turn_boundary=turn_boundary)

    def restore_checkpoint(self, checkpoint: Checkpoint) -> torch.Tensor:
        """Roll back to ``checkpoint.position``; return its logits ([vocab] float32).
        Raises ``EngineError`` when the position is past ``n_past`` or the state has no
        recurrent part."""
        if checkpoint.position > self.n_past:
            raise EngineError(f"checkpoint at {checkpoint.position} is past the {self.n_past} held tokens")
        if not hasattr(self.state, "import_recurrent"):
            raise EngineError(f"{type(self.state).__name__} has no checkpoints")
        with torch.inference_mode():
            self.state.import_recurrent(checkpoint.data, checkpoint.position)
        return checkpoint.logits

    def checkpoint_to_tensors(self, checkpoint: Checkpoint) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``({name: CPU tensor, ..., "logits": [vocab]}, {"fingerprint": ...})``, or None
        for engines that take no checkpoints."""
        if self.can_rewind or not isinstance(checkpoint.data, dict):
            return None
        with torch.no_grad():
            tensors = {name: t.contiguous().cpu() for name, t in checkpoint.data.items()}
            tensors["logits"] = checkpoint.logits.contiguous().cpu()
        return tensors, {"fingerprint": self.fingerprint()}

    def checkpoint_from_tensors(self, position: int, tensors: dict[str, Any], meta: dict[str, Any],
                                turn_boundary: bool = False) -> Checkpoint:
        """Rebuild a checkpoint from :meth:`checkpoint_to_tensors` output. Raises
        ``EngineError`` for another model's data or an engine that takes no checkpoints."""
        if self.can_rewind:
            raise EngineError(f"{type(self.model).__name__} takes no checkpoints")
        if meta.get("fingerprint") not in (None, self.fingerprint()):
            raise EngineError("checkpoint was taken from another model")
        if "logits" not in tensors:
            raise EngineError("checkpoint tensors lack 'logits'")
        with torch.no_grad():
            data = {name: t.to(self.device) for name, t in tensors.items() if name != "logits"}
            logits = tensors["logits"].to(self.device, torch.float32)
        nbytes = sum(_nbytes(t) for t in data.values()) + _nbytes(logits)
        return Checkpoint(position=int(position), logits=logits, data=data, nbytes=nbytes,
                          turn_boundary=turn_boundary)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
