"""The contract between a model implementation and the torch engine.

A model is a :class:`CausalLM`: an ``nn.Module`` built from a Hugging Face ``config.json``
dict, holding only weights (no sequence state). The state of one token sequence (KV caches,
recurrent states) lives in a :class:`ModelState` that the model creates with
:meth:`CausalLM.new_state` and that :meth:`CausalLM.forward` reads and extends in place.

Lifecycle, as the engine uses it::

    model = SomeModel(config)                      # weights uninitialised (torch.empty)
    model.load_hf_weights(tensors)                 # HF names -> parameters; moves/casts
    state = model.new_state(max_tokens, device, dtype)
    logits = model(torch.tensor(ids), state)       # [1, vocab] float32, n_past += len(ids)
    logits = model(torch.tensor([tok]), state)     # decode: one token
    state.truncate(n)                              # KV-only models: roll back to n tokens
    saved = state.export(state.n_past)             # CPU copies of the held part
    state.load(saved, n_past)                      # restore them

Rules every model follows:

* ``forward`` runs under the caller's ``torch.inference_mode()``; it never allocates a
  cache, only writes into the preallocated one, and raises :class:`ContextOverflow`
  (an ``EngineError``) when ``state.n_past + T > state.max_tokens``, leaving the state as
  it was.
* Returned logits are float32 whatever the compute dtype.
* ``ModelState.export`` returns a flat ``dict[str, Tensor]`` of contiguous CPU tensors whose
  names are stable for a given config, so ``safetensors.torch.save_file`` can write it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping

import torch
from torch import nn

from redlite.engine.base import EngineError


class ContextOverflow(EngineError):
    """Raised when a forward pass would hold more tokens than the state was sized for."""


class ModelState(ABC):
    """Per-sequence state of one model (KV caches and/or recurrent states).

    Attributes:
        n_past: tokens held (int, 0 <= n_past <= max_tokens).
        max_tokens: capacity in tokens (int), fixed at creation.
        can_truncate: True when :meth:`truncate` can roll back to any shorter length
            (pure KV-cache models); False for models with recurrent state.

    A state with ``can_truncate`` False also provides, for the engine's checkpoints,
    ``export_recurrent(device=None) -> dict[str, Tensor]`` (copies of the recurrent part at
    ``n_past``, on the state's device by default) and ``import_recurrent(tensors, position)``
    (roll back to ``position <= n_past``: recurrent part copied in, KV caches cut).
    """

    n_past: int
    max_tokens: int
    can_truncate: bool = True

    def check_room(self, n_new: int) -> None:
        """Raise :class:`ContextOverflow` unless ``n_new`` more tokens fit."""
        if n_new < 1:
            raise EngineError("need at least one token")
        if self.n_past + n_new > self.max_tokens:
            raise ContextOverflow(
                f"context overflow: {self.n_past} held + {n_new} new > {self.max_tokens} tokens"
            )

    def reset(self) -> None:
        """Back to the empty sequence (``n_past == 0``) without reallocating. The default
        truncates; states with recurrent parts override it to zero them."""
        self.truncate(0)

    @abstractmethod
    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens (0 <= n_tokens <= n_past).

        Raises ``EngineError`` when out of range or when ``can_truncate`` is False and
        ``n_tokens != n_past`` (recurrent models roll back through their own checkpoints).
        """

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the held part (``n_past`` tokens), not of the preallocation."""

    @abstractmethod
    def export(self, n_tokens: int | None = None) -> dict[str, torch.Tensor]:
        """Contiguous CPU copies of the state of the first ``n_tokens`` tokens
        (default: ``n_past``). Only valid for ``n_tokens == n_past`` when
        ``can_truncate`` is False."""

    @abstractmethod
    def load(self, tensors: Mapping[str, torch.Tensor], n_past: int) -> None:
        """Replace the state by ``tensors`` (as written by :meth:`export`) holding
        ``n_past`` tokens; tensors are copied to the state's device and dtype.

        Raises ``EngineError`` when names or shapes do not match or ``n_past > max_tokens``.
        """


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over one sequence.

    Attributes:
        config: the Hugging Face ``config.json`` dict it was built from.
        vocab_size: number of logits rows (int).
        max_position_embeddings: the trained context length (int).
    """

    config: dict[str, Any]
    vocab_size: int
    max_position_embeddings: int

    @abstractmethod
    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill the parameters from Hugging Face checkpoint names (``model.layers.0...``).

        Tensors may be on any device/dtype; they are copied into the parameters (which keep
        their device and dtype). Raises ``KeyError`` naming a missing weight.
        """

    @abstractmethod
    def new_state(self, max_tokens: int, device: torch.device | str, dtype: torch.dtype) -> ModelState:
        """A fresh empty state (``n_past == 0``) with room for ``max_tokens`` tokens."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, state: ModelState, all_logits: bool = False) -> torch.Tensor:
        """Append ``input_ids`` (LongTensor ``[T]``, T >= 1, on the model's device) at
        position ``state.n_past``; ``state.n_past`` grows by T.

        Returns float32 logits ``[1, vocab]`` for the last position, or ``[T, vocab]`` for
        every position when ``all_logits``. Raises :class:`ContextOverflow` (state untouched)
        when the tokens do not fit.
        """
