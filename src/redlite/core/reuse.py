"""The reuse plan: how much of the held state a new prompt can keep (pure, no engine, no I/O).

A plan is data computed from token ids alone, then executed by the generation runner. Rules
(issue "Conversation state reuse across turns", and the "restore" action of the hybrid-model
issue):

- extend: the held ids are a proper prefix of the new ids; keep them all, prefill the suffix.
- rewind (engine can roll back, e.g. a pure KV cache): keep the common prefix ``c`` and
  prefill the rest; when the new prompt is entirely cached (``c == len(new_ids)``) keep
  ``len(new_ids) - 1`` so the last token is evaluated again and its logits are fresh.
- restore (engine cannot roll back): restore the newest checkpoint at a position
  ``<= min(c, len(new_ids))`` and prefill the rest; a checkpoint exactly at ``len(new_ids)``
  needs no prefill at all (its stored logits are sampled from).
- reset: anything else; full prefill.
- same bytes (``token_bytes`` given): where held and new ids differ but spell the same bytes
  (a re-tokenized answer, :mod:`redlite.core.same_bytes`), the plan is made for the new ids
  with the held spelling of those spans (``plan.same_bytes``; the caller rewrites its prompt),
  when that keeps more of the held state.

The planner asks the engine's capability (``can_rewind``), never the model family.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Sequence

from redlite.core.same_bytes import SameBytes, TokenBytes, align_same_bytes


class Action(str, Enum):
    """What a :class:`ReusePlan` does to the held state (see the module docstring)."""

    EXTEND = "extend"
    REWIND = "rewind"
    RESTORE = "restore"
    RESET = "reset"


class MissReason(str, Enum):
    """Why a plan is not a pure extension (printed in the ``cache miss`` log line)."""

    TOKEN_MISMATCH = "token-mismatch"
    NO_REWIND = "no-rewind"
    DISABLED = "disabled"
    AFTER_FAILURE = "after-failure"
    EMPTY = "empty"
    PROMPT_IS_PREFIX = "prompt-is-prefix"  # every prompt token is held; the held ids go further


@dataclass(frozen=True)
class ReusePlan:
    """What to do with the held state before generating.

    action: see :class:`Action`. keep: tokens of the held state that are reused (the
    ``cached_tokens`` reported to the client). common: length of the common prefix of held and
    new ids. reason: why it is not an extension (None for extend). checkpoint_position: the
    checkpoint to restore (action restore only). prefill: tokens to prefill after ``keep``.
    same_bytes: the re-tokenized spans whose held ids the plan keeps (None: none); the plan's
    lengths are those of the prompt with the held spelling (``same_bytes.prompt_ids``).
    """

    action: Action
    keep: int
    common: int
    prompt_len: int
    held_len: int
    reason: MissReason | None = None
    checkpoint_position: int | None = None
    same_bytes: SameBytes | None = None

    @property
    def prefill(self) -> int:
        return self.prompt_len - self.keep

    def miss_line(self) -> str | None:
        """The one log line for a plan that is not a plain extension (None for extend)."""
        if self.action is Action.EXTEND:
            return None
        head = (f"cache miss held={self.held_len} prompt={self.prompt_len} "
                f"common={self.common} action={self.action.value} reason={self.reason.value}")
        if self.action is Action.RESTORE:
            return f"{head} restore from checkpoint at {self.checkpoint_position} of common {self.common}"
        return head


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token id. start: a
    position up to which the caller knows they agree (compared from there on)."""
    limit = min(len(a), len(b))
    start = min(start, limit)
    # One whole comparison first when the last positions agree (the usual case: one extends the
    # other); then in blocks. Lists compare in C, slicing copies (a few ns per token).
    tail = max(start, limit - 16)
    if a[tail:limit] == b[tail:limit]:
        if start == 0 and (a if len(a) == limit else a[:limit]) == (b if len(b) == limit else b[:limit]):
            return limit
        if start and a[start:limit] == b[start:limit]:
            return limit
    for block in (1024, 64, 8):  # blocks of falling size: at most 15 steps of each after the first
        while start + block <= limit and a[start:start + block] == b[start:start + block]:
            start += block
    while start < limit and a[start] == b[start]:
        start += 1
    return start


def plan_reuse(
    held_ids: Sequence[int],
    new_ids: Sequence[int],
    can_rewind: bool,
    checkpoint_positions: Sequence[int] = (),
    *,
    enabled: bool = True,
    after_failure: bool = False,
    token_bytes: TokenBytes | None = None,
    common: int | None = None,
) -> ReusePlan:
    """Plan how to go from the held state to a state ready to sample after ``new_ids``.

    held_ids: token ids the engine state holds now. new_ids: the new prompt (len >= 1).
    can_rewind: the engine's capability. checkpoint_positions: positions (tokens) of the
    checkpoints of the held sequence (only used when ``can_rewind`` is False); every one is
    ``<= len(held_ids)``. enabled: False for ``--no-reuse``. after_failure: the last request
    failed, so the held state is not trusted. token_bytes: token id -> its bytes (None for a
    special token); given, re-tokenized spans keep their held ids (see the module docstring).
    common: :func:`common_prefix_length` of the two, when the caller knows it.
    Raises ValueError for an empty ``new_ids``.
    """
    if not new_ids:
        raise ValueError("the prompt must hold at least one token")
    held_len, prompt_len = len(held_ids), len(new_ids)

    def reset(reason: MissReason, common: int = 0) -> ReusePlan:
        return ReusePlan(Action.RESET, 0, common, prompt_len, held_len, reason)

    if not enabled:
        return reset(MissReason.DISABLED)
    if after_failure:
        return reset(MissReason.AFTER_FAILURE)
    if held_len == 0:
        return reset(MissReason.EMPTY)
    if common is None:
        common = common_prefix_length(held_ids, new_ids)
    if common == held_len and held_len < prompt_len:
        return ReusePlan(Action.EXTEND, held_len, common, prompt_len, held_len)
    plan = _plan_differing(held_ids, new_ids, common, can_rewind, checkpoint_positions)
    if token_bytes is not None and common < min(held_len, prompt_len):
        same = align_same_bytes(held_ids, new_ids, common, token_bytes)
        if same is not None:
            ids = same.prompt_ids(held_ids, new_ids)  # the held ids up to same.held_end
            respelled = plan_reuse(held_ids, ids, can_rewind, checkpoint_positions,
                                   common=common_prefix_length(held_ids, ids, start=same.held_end))
            if respelled.keep > plan.keep:
                return replace(respelled, same_bytes=same)
    return plan


def _plan_differing(held_ids: Sequence[int], new_ids: Sequence[int], common: int,
                    can_rewind: bool, checkpoint_positions: Sequence[int]) -> ReusePlan:
    """The plan when the new ids do not extend the held ones (rewind, restore or reset)."""
    held_len, prompt_len = len(held_ids), len(new_ids)

    def reset(reason: MissReason, common: int = 0) -> ReusePlan:
        return ReusePlan(Action.RESET, 0, common, prompt_len, held_len, reason)

    why = MissReason.PROMPT_IS_PREFIX if common == prompt_len else MissReason.TOKEN_MISMATCH
    if can_rewind:
        keep = min(common, prompt_len - 1)
        if keep == 0:
            return reset(why, common)
        return ReusePlan(Action.REWIND, keep, common, prompt_len, held_len, why)
    bound = min(common, prompt_len)
    position = max((p for p in checkpoint_positions if 0 < p <= bound), default=0)
    if not position:
        return reset(MissReason.NO_REWIND, common)
    return ReusePlan(Action.RESTORE, position, common, prompt_len, held_len,
                     MissReason.NO_REWIND, checkpoint_position=position)
