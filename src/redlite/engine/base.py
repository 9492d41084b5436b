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
from dataclasses import dataclass, field
from typing import Any, Sequence


class EngineError(RuntimeError):
    """Raised by an engine for a request it cannot serve (e.g. context overflow, bad rewind)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (OpenAI ``temperature``/``top_p``/``seed`` fields,
    plus ``top_k`` and ``min_p`` as in llama.cpp and vLLM).

    temperature: 0 means greedy (argmax). top_k: 0 disables. top_p: 1.0 disables.
    min_p: 0.0 disables (keep tokens whose probability >= min_p * max probability).
    seed: None draws from a fresh random seed; the same seed and request give the same output.

    Logit adjustments, applied in this order before temperature and the filters (see
    :mod:`redlite.engine.logit_rules`):

    logit_bias: ``((token_id, bias), ...)``, bias in [-100, 100] added to that token's logit
        (OpenAI ``logit_bias``; -100 bans a token, 100 all but forces it).
    repetition_penalty: 1.0 disables; a token present in the prompt or the generated tokens
        gets ``logit / r`` when its logit is positive, ``logit * r`` otherwise (the CTRL rule,
        as Hugging Face and vLLM apply it, over prompt + generated tokens).
    frequency_penalty, presence_penalty: in [-2, 2]; OpenAI's definition over the generated
        tokens only: ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
    Then the constrained-decoding mask (tokens the grammar forbids get ``-inf``).

    logprobs: None (off) or how many most likely alternatives to report per generated token
        (0 = only the chosen token's log-probability). Reported log-probabilities are the
        model's own (log-softmax of the raw logits, before bias, penalties, mask and
        temperature), as vLLM reports by default.
    constraint: a :class:`redlite.core.constraints.ConstraintSpec` (grammar the output must
        follow) or None.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    constraint: Any = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether bias or a penalty changes the logits before sampling."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 \
            or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


    @property
    def needs_host(self) -> bool:
        """Whether sampling needs the host's view of the logits: a logit rule, a grammar or
        logprobs (a :class:`TokenStream` serves only requests without them)."""
        return self.adjusts_logits or self.constraint is not None or self.logprobs is not None


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability record of one generated token (when ``SamplingParams.logprobs`` is set).

    token_id: the chosen token. logprob: its natural-log probability under the model.
    top: the ``SamplingParams.logprobs`` most likely tokens as ``(token_id, logprob)``, most
        likely first (empty when 0 were asked for).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Sampler(ABC):
    """Picks the next token id from logits; holds the state of one request's sampling: its
    random generator, the token counts penalties need, the grammar matcher.

    ``last_logprob``: the :class:`TokenLogprob` of the token the last :meth:`sample` returned
    (None unless ``SamplingParams.logprobs`` is set).
    """

    last_logprob: TokenLogprob | None = None

    @abstractmethod
    def sample(self, logits: Any) -> int:
        """Return the next token id (an int in ``[0, vocab_size)``) for the given logits and
        record it as generated (penalty counts, grammar state)."""


class TokenStream(ABC):
    """Decoding run one token ahead of the host: the engine samples every token itself
    (on its device), so it can feed a token into the model before the host has read it.

    Opened by :meth:`Engine.token_stream` with the logits at the held state's end, it has
    sampled the first token. :meth:`feed` feeds the newest sampled token (``n_past`` grows
    by 1) and samples the one after it, without waiting; :meth:`read` returns the oldest
    sampled token the host has not read yet (blocking until it exists); :meth:`undo` takes
    back the last :meth:`feed` when its token turns out not to belong to the held sequence
    (end of turn, a stop sequence). The caller keeps its held ids in step: at most one fed
    token is not confirmed at a time.
    """

    @abstractmethod
    def feed(self) -> None:
        """Feed the newest sampled token at ``n_past`` and sample the next. Raises
        :class:`EngineError` on a full context."""

    @abstractmethod
    def read(self) -> int:
        """The oldest sampled token id not read yet (an int in ``[0, vocab_size)``)."""

    @abstractmethod
    def undo(self) -> None:
        """Undo the last :meth:`feed`: ``n_past`` and the state are as before it. Once per feed."""


@dataclass
class StateSnapshot:
    """A copy of an engine's held state, detached from the engine (host memory).

    n_past: tokens held (int). tensors: name -> array (``torch.Tensor`` on CPU for the torch
    engine, ``numpy.ndarray`` for the echo engine); ``tensor_format`` says which, so the disk
    tier can pick ``safetensors.torch`` or ``safetensors.numpy``. meta: JSON-serialisable
    extras (layout, checkpoint positions). nbytes: total tensor bytes.
    """

    n_past: int
    tensors: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    tensor_format: str = "torch"

    @property
    def nbytes(self) -> int:
        total = 0
        for array in self.tensors.values():
            if hasattr(array, "nbytes"):
                total += int(array.nbytes)
            else:
                total += int(array.numel() * array.element_size())
        return total


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
        ``slots[i].decode(token_ids[i])`` alone. Raises :class:`EngineError` on a full context
        of any slot, before changing any state. Default: a loop over :meth:`decode`."""
        if len(slots) != len(token_ids):
            raise EngineError(f"{len(slots)} slots but {len(token_ids)} tokens")
        if len({id(slot) for slot in slots}) != len(slots):
            raise EngineError("decode_batch needs distinct slots")
        for slot in slots:
            if slot.n_past + 1 > slot.max_context:
                raise EngineError(f"context overflow: {slot.n_past} + 1 > {slot.max_context}")
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
