"""Which idle slot a request runs in (pure): the first step of placing a conversation.

Running slots are never candidates: a request never evicts a running conversation. Among the
idle slots (each holding its resident conversation, or nothing), a request takes:

1. the slot with the longest usable prefix for its prompt (:func:`~redlite.core.parking.usable_prefix`),
   but a slot whose resident conversation it would cut (it does not extend it) counts only when
   that prefix is at least half of what the slot holds (:data:`FORK_SHARE`: a fork of that
   conversation, a regenerate or an edit); a smaller shared prefix (a common system prompt)
   is cheaper to copy into another slot (below) than the resident conversation is to park
   and bring back;
2. on a tie: a slot that loses nothing (empty, or extended); then, among slots that would be
   cut anyway, the one sharing the longest prefix with the prompt (a regenerate of a long
   answer rewinds its own slot rather than cutting an unrelated conversation and prefilling
   the prompt again); then the slot of the request's session key, then the least recently
   used.

When another idle slot's resident conversation has a longer usable prefix than the chosen
slot's own (one that rule 1 did not take: it would be cut to less than :data:`FORK_SHARE`), the
chosen slot starts from a copy of that prefix (:class:`Placement` ``source``, ``keep``) instead
of from nothing; the source slot is left as it is (a fork by copy: an edited earlier answer, a
new conversation with the same system prompt and tools).

The chosen slot's generator then runs the candidate step
(:meth:`redlite.core.conversations.Conversations.select`): the offered copy, a parked
conversation or the resident one, whichever has the longest usable prefix; a resident that
would lose tokens parks (RAM, then disk tiers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from redlite.core.parking import usable_prefix
from redlite.core.reuse import common_prefix_length

FORK_SHARE = 0.5  # a cut resident counts when the prompt keeps at least this share of it


@dataclass(frozen=True)
class SlotView:
    """An idle slot as placement sees it. held_ids: its resident conversation's tokens.
    trusted: its state agrees with them. checkpoints: positions (tokens). last_used:
    monotonic seconds of its last request's end."""

    index: int
    held_ids: Sequence[int]
    trusted: bool
    can_rewind: bool
    checkpoints: Sequence[int] = ()
    session_key: str | None = None
    last_used: float = 0.0


@dataclass(frozen=True)
class Placement:
    """Where a request runs: ``slot``; ``source``: the idle slot whose resident conversation's
    first ``keep`` tokens ``slot`` copies to start from (None: no copy); ``reason``: why, for
    the log line."""

    slot: int
    source: int | None = None
    keep: int = 0
    reason: str = ""


def view_usable(view: SlotView, prompt: Sequence[int]) -> int:
    """Tokens of ``view``'s resident conversation that ``prompt`` can keep (:func:`usable_prefix`)."""
    held = len(view.held_ids) if view.trusted else 0
    common = common_prefix_length(view.held_ids, prompt) if held else 0
    return usable_prefix(held, common, len(prompt), view.can_rewind, view.checkpoints)


def slot_rank(view: SlotView, prompt: Sequence[int], session_key: str | None) -> tuple:
    """The sort key of ``view`` for ``prompt`` (the best slot has the largest)."""
    held = len(view.held_ids) if view.trusted else 0
    usable = view_usable(view, prompt)
    loses = held > usable
    shared = usable
    if loses and usable < FORK_SHARE * held:
        usable = 0
    same_session = session_key is not None and session_key == view.session_key
    return usable, not loses, shared, same_session, -view.last_used


def choose_slot(views: Sequence[SlotView], prompt: Sequence[int],
                session_key: str | None = None) -> int:
    """The index of the idle slot for ``prompt`` (see module docstring). Raises ValueError
    when ``views`` is empty."""
    return place(views, prompt, session_key).slot


def place(views: Sequence[SlotView], prompt: Sequence[int],
          session_key: str | None = None) -> Placement:
    """The idle slot for ``prompt`` and the slot whose prefix it copies, if any (see module
    docstring). Raises ValueError when ``views`` is empty."""
    if not views:
        raise ValueError("no idle slot")
    ranks = {v.index: slot_rank(v, prompt, session_key) for v in views}
    chosen = max(views, key=lambda v: ranks[v.index])
    usable, intact, own = ranks[chosen.index][:3]
    if intact:
        why = f"its resident kept ({own} tok usable)" if usable else "empty"
    elif usable:
        why = f"a fork of its resident ({own} tok kept)"
    else:
        why = f"every idle slot loses its resident; this one keeps {own} tok"
    donors = [v for v in views if v.index != chosen.index and ranks[v.index][2] > own]
    if not donors:
        return Placement(chosen.index, reason=why)
    donor = max(donors, key=lambda v: (ranks[v.index][2], v.last_used))
    keep = ranks[donor.index][2]
    return Placement(chosen.index, donor.index, keep,
                     f"{why}; copies {keep} tok of slot {donor.index}, which keeps its "
                     f"{len(donor.held_ids)} tok")
