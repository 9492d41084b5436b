"""Per-sequence state of a Qwen3.5 model and the export/import of its recurrent part.

:class:`Qwen3_5State` holds, per linear-attention layer, a conv state and a float32
recurrent state (fixed size), and for the full-attention layers a preallocated KV cache. It
cannot be truncated (the recurrent part has no history); it rolls back through
:meth:`Qwen3_5State.export_recurrent` / :meth:`Qwen3_5State.import_recurrent` (also as the
module-level :func:`export_recurrent` / :func:`import_recurrent`), and parks through
:meth:`Qwen3_5State.export` / :meth:`Qwen3_5State.load`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from redlite.engine.base import EngineError
from redlite.layers.kv_cache import KVCache
from redlite.models.base import ModelState
from redlite.models.qwen3_5_config import LINEAR

if TYPE_CHECKING:
    from redlite.models.qwen3_5 import Qwen3_5Model

__all__ = ["Qwen3_5State", "export_recurrent", "import_recurrent"]


class Qwen3_5State(ModelState):
    """State of one sequence of a :class:`~redlite.models.qwen3_5.Qwen3_5Model`.

    * linear-attention layer ``i``: ``conv[i]`` ``[C, K - 1]`` in the compute dtype (the last
      ``K - 1`` inputs of the short convolution, zeros at start) and ``recurrent[i]``
      ``[Hv, Dk, Dv]`` float32 (the delta-rule memory); fixed size whatever ``n_past``;
    * full-attention layers: one :class:`~redlite.layers.kv_cache.KVCache` ``cache`` (slot
      ``kv_slot[i]`` for layer ``i``), ``[Hkv, max_tokens, D]`` per layer and K/V,
      preallocated uninitialised in the compute dtype; rows ``< n_past`` are valid.

    ``can_truncate`` is False as soon as there is one linear-attention layer: roll back with
    :meth:`export_recurrent` at position P and :meth:`import_recurrent` (which also cuts the
    KV caches to P).
    """

    def __init__(self, model: "Qwen3_5Model", max_tokens: int, device: torch.device | str, dtype: torch.dtype):
        if max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {max_tokens}")
        self.n_past = 0
        self.device = torch.device(device)
        self.dtype = dtype
        self.layer_types = list(model.layer_types)
        self.can_truncate = LINEAR not in self.layer_types
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.kv_slot: dict[int, int] = {}
        shapes = {}
        for i, layer in enumerate(model.layers):
            if layer.layer_type == LINEAR:
                mixer = layer.linear_attn
                shapes[i] = (mixer.conv_state_shape(), mixer.recurrent_state_shape())
            else:
                self.kv_slot[i] = len(self.kv_slot)
        # every conv state is a view of one flat tensor, every recurrent state of another, so a
        # checkpoint is two copies (not two per layer)
        self._flat = (torch.zeros(sum(_numel(c) for c, _ in shapes.values()), device=self.device, dtype=dtype),
                      torch.zeros(sum(_numel(r) for _, r in shapes.values()), device=self.device,
                                  dtype=torch.float32))
        self.conv, self.recurrent = _views(self._flat, shapes)
        self._shapes = shapes
        # the payload's names per layer, its size and the state's own tensors by name: fixed
        self._names = {i: (f"layers.{i}.conv", f"layers.{i}.recurrent") for i in shapes}
        self._recurrent_bytes = sum(t.numel() * t.element_size()
                                    for t in (*self.conv.values(), *self.recurrent.values()))
        self._targets = {}
        for i, (conv_name, recurrent_name) in self._names.items():
            self._targets[conv_name], self._targets[recurrent_name] = self.conv[i], self.recurrent[i]
        cfg = model.text_config
        n_heads = int(cfg["num_attention_heads"])
        self.cache = KVCache(len(self.kv_slot), int(cfg.get("num_key_value_heads") or n_heads),
                             int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
                             max_tokens, self.device, dtype)
        self.max_tokens = self.cache.max_tokens

    # --- addresses (batched CUDA graphs) ----------------------------------------------------

    def buffer_addresses(self) -> tuple[int, int, int]:
        """Device addresses of this state's fixed buffers: the KV cache's ``data``, the flat
        conv buffer and the flat float32 recurrent buffer. They are allocated once and never
        moved (reset, rollback and loads copy into them), so batched CUDA graphs read them
        from a table refilled before each replay."""
        return (self.cache.data.data_ptr(), self._flat[0].data_ptr(), self._flat[1].data_ptr())

    def layer_offsets(self, layer: int) -> tuple[int, int]:
        """Elements from the flat conv and recurrent buffers' starts to linear-attention
        layer ``layer``'s conv and recurrent states (the same in every state of one model)."""
        return (self.conv[layer].data_ptr() - self._flat[0].data_ptr()) // self._flat[0].element_size(), \
            (self.recurrent[layer].data_ptr() - self._flat[1].data_ptr()) // 4

    # --- sizes --------------------------------------------------------------------------------

    def recurrent_nbytes(self) -> int:
        """Bytes of the conv + recurrent states (one checkpoint payload); independent of n_past."""
        return self._recurrent_bytes

    def nbytes(self) -> int:
        """Bytes of the held part: conv + recurrent states plus ``n_past`` tokens of KV cache."""
        return self.recurrent_nbytes() + self.cache.nbytes(self.n_past)

    # --- rollback -----------------------------------------------------------------------------

    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens.

        With a linear-attention layer only ``n_tokens == n_past`` (a no-op) is allowed;
        otherwise raises ``EngineError`` (use :meth:`import_recurrent`). Pure-attention
        patterns truncate freely. Raises ``EngineError`` when out of range.
        """
        if not 0 <= n_tokens <= self.n_past:
            raise EngineError(f"cannot truncate to {n_tokens} tokens: {self.n_past} held")
        if n_tokens != self.n_past and not self.can_truncate:
            raise EngineError("Qwen3.5 state has recurrent layers: roll back with import_recurrent")
        self.n_past = int(n_tokens)

    def reset(self) -> None:
        """Back to the empty sequence (``n_past = 0``, zero conv/recurrent states) without
        reallocating: position 0 is the one rollback target that needs no checkpoint."""
        with torch.inference_mode():
            for flat in self._flat:
                flat.zero_()
        self.n_past = 0

    def export_recurrent(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Copies of every conv and recurrent state: the checkpoint payload at ``n_past``.

        Returns ``{"layers.{i}.conv": [C, K-1] compute dtype, "layers.{i}.recurrent":
        [Hv, Dk, Dv] float32}`` for each linear-attention layer ``i``, on ``device``
        (default: the state's device, fastest on GPU; ``"cpu"`` for host copies). Total
        size: :meth:`recurrent_nbytes`. KV caches are not included: they are append-only,
        so cutting them back (done by :meth:`import_recurrent`) restores them. The tensors are
        views of two flat copies (one per dtype): two device copies per checkpoint.
        """
        target = self.device if device is None else torch.device(device)
        flats = tuple(flat.to(target, copy=True) for flat in self._flat)
        conv, recurrent = _views(flats, self._shapes)
        out = _Payload()
        out.flats, out.layout = flats, self._shapes
        for i, (conv_name, recurrent_name) in self._names.items():
            out[conv_name], out[recurrent_name] = conv[i], recurrent[i]
        return out

    def save_recurrent(self, payload: Mapping[str, torch.Tensor]) -> None:
        """Copy the conv/recurrent states into ``payload``, an :meth:`export_recurrent` result
        on this state's device (two copies, no allocation: capturable in a CUDA graph)."""
        for dest, src in zip(payload.flats, self._flat):
            dest.copy_(src)

    def import_recurrent(self, tensors: Mapping[str, torch.Tensor], position: int) -> None:
        """Roll back to ``position`` tokens with a payload from :meth:`export_recurrent`.

        ``tensors`` must be what ``export_recurrent`` returned when ``n_past`` was
        ``position``, and the first ``position`` tokens held now must be those same tokens
        (the caller's bookkeeping). Copies the conv/recurrent states in (any device/dtype)
        and cuts the KV caches to ``position``. Raises ``EngineError`` when
        ``position > n_past`` or names/shapes do not match; the state is unchanged then.
        """
        if not 0 <= position <= self.n_past:
            raise EngineError(f"cannot roll back to {position} tokens: {self.n_past} held")
        targets = self._recurrent_targets()
        # a payload of a state of this layout holds its names and shapes (no tensor-by-tensor check)
        if getattr(tensors, "layout", None) != self._shapes or len(tensors) != len(targets):
            self._check(tensors, targets)
        with torch.inference_mode():
            self._copy_in(tensors, targets)
        self.n_past = int(position)

    def _copy_in(self, tensors: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into ``targets`` (same names): one flat copy per dtype when the
        tensors are a payload of :meth:`export_recurrent`, else one multi-tensor copy."""
        flats = getattr(tensors, "flats", ())
        if len(flats) == 2 and all(f.shape == d.shape for f, d in zip(flats, self._flat)):
            for dest, src in zip(self._flat, flats):
                dest.copy_(src)
            return
        names = list(targets)
        srcs, dests = [tensors[n] for n in names], [targets[n] for n in names]
        if all(s.device == d.device and s.dtype == d.dtype for s, d in zip(srcs, dests)):
            torch._foreach_copy_(dests, srcs)
        else:
            for dest, src in zip(dests, srcs):
                dest.copy_(src)

    def _recurrent_targets(self) -> dict[str, torch.Tensor]:
        """The state's own conv and recurrent tensors by payload name (one dict: not to be changed)."""
        return self._targets

    # --- parking ------------------------------------------------------------------------------

    def export(self, n_tokens: int | None = None) -> dict[str, torch.Tensor]:
        """Contiguous CPU copies of the whole held state: the :meth:`export_recurrent`
        tensors plus ``"kv"`` ``[n_full_layers, 2, Hkv, n_tokens, D]`` (as
        :meth:`KVCache.export <redlite.layers.kv_cache.KVCache.export>`). Size:
        :meth:`nbytes`. ``n_tokens`` must equal ``n_past`` unless ``can_truncate``;
        raises ``EngineError`` otherwise.
        """
        n = self.n_past if n_tokens is None else int(n_tokens)
        if not 0 <= n <= self.n_past or (n != self.n_past and not self.can_truncate):
            raise EngineError(f"cannot export {n} tokens of a Qwen3.5 state holding {self.n_past}")
        # one CPU tensor per name (not views of one buffer: safetensors refuses shared storage)
        out = {name: t.to("cpu", copy=True) for name, t in self._recurrent_targets().items()}
        out["kv"] = self.cache.export(n)
        return out

    def load(self, tensors: Mapping[str, torch.Tensor], n_past: int) -> None:
        """Replace the state by ``tensors`` from :meth:`export` holding ``n_past`` tokens.

        Tensors are copied to the state's device and dtype. Raises ``EngineError`` when
        names or shapes do not match or ``n_past > max_tokens``; the state is unchanged then.
        """
        if not 0 <= n_past <= self.max_tokens:
            raise EngineError(f"cannot load {n_past} tokens into a state of {self.max_tokens}")
        targets = self._recurrent_targets()
        expected = dict(targets)
        kv = self.cache.data[:, :, :, :n_past]
        expected["kv"] = kv
        self._check(tensors, expected)
        with torch.inference_mode():
            self._copy_in(tensors, targets)
            kv.copy_(tensors["kv"])
        self.n_past = int(n_past)

    @staticmethod
    def _check(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
        if set(tensors) != set(expected):
            missing = sorted(set(expected) - set(tensors))
            extra = sorted(set(tensors) - set(expected))
            raise EngineError(f"state tensors do not match this model: missing {missing[:4]}, "
                              f"unexpected {extra[:4]}")
        for name, dest in expected.items():
            if tuple(tensors[name].shape) != tuple(dest.shape):
                raise EngineError(f"state tensor {name}: shape {tuple(tensors[name].shape)}, "
                                  f"expected {tuple(dest.shape)}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _views(flats: tuple[torch.Tensor, torch.Tensor], shapes: dict) -> tuple[dict, dict]:
    """Per-layer conv and recurrent views of the two (contiguous) flat tensors, in layer order:
    one ``unbind`` per flat when every layer's shape is the same (each view is a torch call of
    a few microseconds, on the host whatever the device), else a slice per layer."""
    layers, out = list(shapes), []
    for j, flat in enumerate(flats):
        kinds = [shapes[i][j] for i in layers]
        if kinds and all(shape == kinds[0] for shape in kinds):
            parts = flat.view(len(kinds), *kinds[0]).unbind(0)
        else:
            parts, offset = [], 0
            for shape in kinds:
                parts.append(flat[offset:offset + _numel(shape)].view(shape))
                offset += _numel(shape)
        out.append(dict(zip(layers, parts)))
    return out[0], out[1]


class _Payload(dict):
    """A checkpoint payload (name -> view) that also keeps the two flat tensors it views and
    the layout (layer -> shapes) of the state that made it; never changed once made."""

    flats: tuple[torch.Tensor, torch.Tensor] = ()
    layout: dict | None = None


def export_recurrent(state: Qwen3_5State, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Module-level alias of :meth:`Qwen3_5State.export_recurrent`."""
    return state.export_recurrent(device)


def import_recurrent(state: Qwen3_5State, tensors: Mapping[str, torch.Tensor], position: int) -> None:
    """Module-level alias of :meth:`Qwen3_5State.import_recurrent`."""
    state.import_recurrent(tensors, position)
