"""The single-sequence contract between the server core and an engine.

The server core (queue, reuse planning, stop scanning, parking) talks to a model only
through :class:`Engine`. An engine holds the model state of exactly one token sequence
(the "held" sequence): a KV cache for attention layers, recurrent states for linear
attention layers. The core keeps the token ids of that sequence itself and guarantees
that ``len(held_ids) == engine.n_past`` at every moment.

Logits are opaque to the core: it only hands them back to the engine's sampler. For the
torch engine they are a ``torch.Tensor`` of shape ``[vocab_size]``, dtype float32, on the
engine's device; for the echo engine a small object naming the next token.

This module must not import torch: the core is importable and testable without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from redlite.engine.errors import EngineError
from redlite.engine.picks import PICKED, PickHandle, mark_picks, resolve_picks
from redlite.engine.sampler import Sampler, TokenStream
from redlite.engine.sampling_params import SamplingParams, TokenLogprob
from redlite.engine.state import Checkpoint, StateSnapshot, has_end_state, range_of

__all__ = ["PICKED", "Checkpoint", "Engine", "EngineError", "PickHandle", "Sampler", "SamplingParams", "StateSnapshot",
           "TokenLogprob", "TokenStream", "has_end_state", "range_of"]


class Engine(ABC):
    """One sequence of model state.

    Attributes:
        model_id: name served in ``/v1/models`` and in responses.
        can_rewind: True when :meth:`rewind` can truncate the held state to any shorter
            length (a pure KV-cache model). False for models with recurrent state, which
            roll back only through :class:`Checkpoint` s.
        max_context: the most tokens the state can hold (``--ctx-size``).
        vocab_size: number of token ids.
    """

    model_id: str = "model"
    can_rewind: bool = True
    max_context: int = 0
    vocab_size: int = 0
    #: True when :meth:`prefill` returns once its work is queued on a device (the logits are
    #: read later), not done: a short prefill is then launched before its job reports started
    launches_async: bool = False

    @property
    @abstractmethod
    def n_past(self) -> int:
        """Tokens held in the state (int)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop the held state: ``n_past`` becomes 0."""

    @abstractmethod
    def prefill(self, token_ids: Sequence[int]) -> Any:
        """Feed ``token_ids`` (len >= 1) after the held tokens in one batch.

        Returns the logits of the last position. Raises :class:`EngineError` when
        ``n_past + len(token_ids) > max_context``.
        """

    @abstractmethod
    def decode(self, token_id: int) -> Any:
        """Feed one token after the held tokens; return the logits of the next position."""

    def new_slot(self) -> "Engine":
        """Another sequence slot sharing this engine's model (weights, device, options) with its
        own empty state (``n_past == 0``): a full single-sequence :class:`Engine` in every other
        respect (prefill, rewind, snapshot, ranges, checkpoints of its own state). The engine it
        was made from and all its slots form one pool: :meth:`decode_batch` takes any of them.
        Raises :class:`EngineError` when the engine cannot (then the server runs ``--parallel 1``).
        Memory: each slot owns its state; the docstring of the engine says how it is allocated."""
        raise EngineError(f"{type(self).__name__} cannot make another sequence slot")

    def decode_batch(self, slots: Sequence["Engine"], token_ids: Sequence[int]) -> list[Any]:
        """One decode step over ``len(slots)`` distinct slots of this pool: feed ``token_ids[i]``
        after ``slots[i]``'s held tokens (each ``n_past`` grows by 1) and return each slot's
        logits of its next position, in order -- the same values (greedy: the same argmax) as
        ``slots[i].decode(token_ids[i])`` alone. A token may be
        :data:`~redlite.engine.picks.PICKED`: the slot's pick of :meth:`greedy_batch_async`.
        Raises :class:`EngineError` on a full context of any slot, before changing any state.
        Default: a loop over :meth:`decode`."""
        if len(slots) != len(token_ids):
            raise EngineError(f"{len(slots)} slots but {len(token_ids)} tokens")
        if len({id(slot) for slot in slots}) != len(slots):
            raise EngineError("decode_batch needs distinct slots")
        for slot in slots:
            if slot.n_past + 1 > slot.max_context:
                raise EngineError(f"context overflow: {slot.n_past} + 1 > {slot.max_context}")
        token_ids = resolve_picks(slots, token_ids)
        return [slot.decode(token_id) for slot, token_id in zip(slots, token_ids)]

    def rewind(self, n_tokens: int) -> None:
        """Truncate the held state to its first ``n_tokens`` tokens (0 <= n_tokens <= n_past).

        Raises :class:`EngineError` when ``can_rewind`` is False or ``n_tokens`` is out of range.
        """
        raise EngineError(f"{type(self).__name__} cannot rewind")

    @abstractmethod
    def make_sampler(self, params: SamplingParams, prompt_ids: Sequence[int] = (),
                     constraint: Any = None) -> Sampler:
        """A sampler for one request (holds its seeded random generator).

        prompt_ids: the request's prompt (``repetition_penalty`` counts it). constraint: a
        :class:`redlite.core.grammar.GrammarMatcher` for ``params.constraint``, or None."""

    def greedy_batch(self, rows: Sequence[Any]) -> list[int]:
        """The greedy token of each of ``rows`` (logits as :meth:`decode` returns them): what a
        greedy sampler of :meth:`make_sampler` picks for each. Engines on a device override it
        to read all the ids back at once."""
        sampler = self.make_sampler(SamplingParams(temperature=0.0))
        return [int(sampler.sample(row)) for row in rows]

    def greedy_batch_async(self, slots: Sequence["Engine"], rows: Sequence[Any]) -> PickHandle:
        """:meth:`greedy_batch` of ``rows`` (the logits of ``slots``' last decode) as a
        :class:`~redlite.engine.picks.PickHandle`, each slot marked with its pick, so that
        :meth:`decode_batch` may take :data:`~redlite.engine.picks.PICKED` for it next.
        Engines on a device return before the ids reach the host. Default: picked now."""
        return mark_picks(slots, PickHandle(self.greedy_batch(rows)))

    def token_stream(self, params: SamplingParams, logits: Any) -> TokenStream | None:
        """A :class:`TokenStream` sampling with ``params`` from ``logits`` (the logits at
        ``n_past``), or None when this engine cannot sample those params itself (a logit
        rule, a grammar, logprobs): the caller then samples on the host with
        :meth:`make_sampler`. ``params.seed``: as for :meth:`make_sampler`."""
        return None

    @abstractmethod
    def snapshot(self) -> StateSnapshot:
        """Copy the held state (and checkpoints, where the engine has them) to host memory."""

    @abstractmethod
    def restore(self, snapshot: StateSnapshot) -> None:
        """Replace the held state by ``snapshot``; ``n_past`` becomes ``snapshot.n_past``."""

    def restore_targets(self, n_past: int) -> dict[str, Any] | None:
        """Writable views of the engine's own state memory that :meth:`restore` of an
        ``n_past``-token snapshot would fill (name -> tensor), so a saved state can be read
        straight into place; None when the engine offers none. Taking them drops the held
        state (``n_past`` becomes 0); follow with :meth:`restore` of a snapshot holding these
        very tensors (no copy then), or :meth:`reset`."""
        return None

    @abstractmethod
    def state_nbytes(self) -> int:
        """Bytes the held state occupies for its ``n_past`` tokens (not the preallocation)."""

    # --- token ranges: parking only the tail a fork discards ---------------------------------

    #: True when ``snapshot_range(..., on_device=True)`` keeps its copy in memory apart from the
    #: host's (a CUDA engine); such copies count against the device parking budget.
    device_resident: bool = False

    def range_nbytes(self, start: int, stop: int | None = None) -> int:
        """Bytes :meth:`snapshot_range` ``(start, stop)`` would hold (``stop`` default
        ``n_past``; the state at the end included when ``stop == n_past``)."""
        raise EngineError(f"{type(self).__name__} has no token ranges")

    def snapshot_range(self, start: int, stop: int | None = None,
                       on_device: bool = False) -> StateSnapshot:
        """Copy of held tokens ``[start, stop)`` (``stop`` default ``n_past``): their per-token
        state (KV rows), plus, when ``stop == n_past``, the state that is not per token
        (recurrent states; the "end state"). ``meta["range"] == [start, stop]``,
        ``meta["end_state"]`` says whether the end state is in; ``n_past`` is ``stop``. ``on_device``: keep the copy in
        the engine's device memory (see :attr:`device_resident`), else in host memory.
        ``snapshot_range(0)`` is a whole snapshot :meth:`restore` accepts.
        Raises :class:`EngineError` when ``0 <= start <= stop <= n_past`` does not hold."""
        raise EngineError(f"{type(self).__name__} has no token ranges")

    def restore_range(self, snapshot: StateSnapshot) -> None:
        """Put a :meth:`snapshot_range` copy back at its start: the held state is cut to
        ``start`` (``n_past >= start`` required) and the range appended; ``n_past`` becomes
        its ``stop``. The caller guarantees that the held tokens ``[0, start)`` are those (and
        computed as) when the range was taken. A range without the end state leaves the
        non-per-token part undefined until a later range that has it (rewindable engines have
        none). Raises :class:`EngineError` on a mismatch (another model, shapes, n_past < start,
        beyond ``max_context``); the held state is then undefined (reset it)."""
        raise EngineError(f"{type(self).__name__} has no token ranges")

    def slice_range(self, snapshot: StateSnapshot, start: int, stop: int) -> StateSnapshot:
        """The part ``[start, stop)`` of a range (or whole) snapshot covering it, without
        copying where the engine can (views); the end state only when ``stop`` is the
        snapshot's own stop. Raises :class:`EngineError` when not covered."""
        raise EngineError(f"{type(self).__name__} has no token ranges")

    def join_ranges(self, pieces: Sequence[StateSnapshot], on_device: bool = False) -> StateSnapshot:
        """One snapshot of adjacent ranges (each piece's stop is the next one's start), the end
        state from the last piece; in device memory when ``on_device``, else host memory
        (fresh contiguous tensors either way). From 0 with the end state: a whole snapshot
        (what :meth:`restore` and the disk tier take). Raises :class:`EngineError` when the
        pieces are not adjacent."""
        raise EngineError(f"{type(self).__name__} has no token ranges")

    def copy_prefix(self, source: "Engine", n_tokens: int) -> None:
        """Hold the first ``n_tokens`` tokens of ``source`` (another slot of this pool, left
        unchanged): their per-token state (KV rows) copied into this slot's own memory, device to
        device on an accelerator; ``n_past`` becomes ``n_tokens``. The state that is not per
        token (recurrent states) is copied only with the whole held state (``n_tokens ==
        source.n_past``, as :meth:`snapshot_range`); otherwise it is undefined until
        :meth:`restore_checkpoint` of ``source``'s checkpoint at ``n_tokens``.
        Raises :class:`EngineError` for ``source`` itself or a slot of another pool, ``n_tokens``
        outside ``[0, source.n_past]`` or past ``max_context``; the held state is then undefined
        (reset it). Default: :meth:`snapshot_range` of ``source`` in device memory, then
        :meth:`restore_range`."""
        if source is self:
            raise EngineError("copy_prefix needs another slot")
        if not 0 <= n_tokens <= min(source.n_past, self.max_context):
            raise EngineError(f"cannot copy {n_tokens} of {source.n_past} tokens")
        self.restore_range(source.snapshot_range(0, n_tokens, on_device=True))

    # --- checkpoints: only engines that cannot rewind need them -----------------------------

    def take_checkpoint(self, logits: Any, turn_boundary: bool = False) -> Checkpoint | None:
        """Checkpoint the recurrent state at ``n_past`` (with ``logits`` of that position).

        Returns None for engines that can rewind (they need no checkpoints).
        """
        return None

    def restore_checkpoint(self, checkpoint: Checkpoint) -> Any:
        """Roll the state back to ``checkpoint.position``; return the logits stored there.

        Raises :class:`EngineError` when ``checkpoint.position > n_past``.
        """
        raise EngineError(f"{type(self).__name__} has no checkpoints")

    def checkpoint_to_tensors(self, checkpoint: Checkpoint) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Host form of ``checkpoint`` for parking and the disk tier: ``(tensors, meta)`` with
        tensors a name -> CPU array dict (``torch.Tensor`` or ``numpy.ndarray``, as the
        engine's ``StateSnapshot.tensor_format``; the stored logits included) and meta a
        JSON-serialisable dict. None when the engine does not support it: parked
        conversations then keep their checkpoint objects in RAM as they are and the disk tier
        stores none (an engine that cannot rewind then restores a saved conversation only
        when the prompt extends it)."""
        return None

    def checkpoint_from_tensors(self, position: int, tensors: dict[str, Any], meta: dict[str, Any],
                                turn_boundary: bool = False) -> Checkpoint:
        """Rebuild a :class:`Checkpoint` at ``position`` (tokens) from
        :meth:`checkpoint_to_tensors` output (tensors may come back from a file, on CPU).
        Raises :class:`EngineError` when the engine does not support it or the data do not
        match the model."""
        raise EngineError(f"{type(self).__name__} cannot rebuild checkpoints from tensors")

    def fingerprint(self) -> str:
        """A stable id of the model (config + weights) so saved states are not loaded into
        another model. Engines override this."""
        return self.model_id
