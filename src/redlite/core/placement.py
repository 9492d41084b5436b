"""Which idle slot a request runs in (pure): the first step of placing a conversation.

Running slots are never candidates: a request never evicts a running conversation. Among the
idle slots (each holding its resident conversation, or nothing), a request takes:

1. the slot with the longest usable prefix for its prompt (:func:`~redlite.core.parking.usable_prefix`),
   but a slot whose resident conversation it would cut (it does not extend it) counts only when
   the request continues that conversation: the cut falls in the resident's last answer (a
   regenerate, an answer the client spells differently) or, where the slot does not know where
   that answer starts, the prompt keeps at least half of what the slot holds
   (:data:`FORK_SHARE`). Another conversation sharing a prefix with the resident (a common
   system prompt and tools, however long; an edited message) does not count: copying
   that prefix into another slot (below) is cheaper than parking the resident and bringing it
   back, which two conversations taking turns would otherwise do on every turn;
2. on a tie: a slot that loses nothing (empty, or extended); then, among slots that would be
   cut anyway, one whose resident holds the whole prompt (a regenerate of a long answer
   rewinds its own slot rather than cutting an unrelated conversation); then the slot of the
   request's session key, then the least recently used (the least valuable resident: not the
   conversation that shares the prompt's system prompt and was answered a moment ago).

When another idle slot's resident conversation has a longer usable prefix than the chosen
slot's own (one that rule 1 did not take), the chosen slot starts from a copy of that prefix
(:class:`Placement` ``source``, ``keep``) instead of from nothing; the source slot is left as
it is (a fork by copy: an edited earlier answer, a new conversation with the same system
prompt and tools).

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

FORK_SHARE = 0.5  # a cut resident of unknown answer start counts when the prompt keeps this share


@dataclass(frozen=True)
class SlotView:
    """An idle slot as placement sees it. held_ids: its resident conversation's tokens.
    trusted: its state agrees with them. checkpoints: positions (tokens). last_used:
    monotonic seconds of its last request's end. answer_start: where the resident's last
    generated answer starts in held_ids (None: not known: installed by the slot API, or cut
    before its answer by a request that stopped in its prefill)."""

    index: int
    held_ids: Sequence[int]
    trusted: bool
    can_rewind: bool
    checkpoints: Sequence[int] = ()
    session_key: str | None = None
    last_used: float = 0.0
    answer_start: int | None = None


@dataclass(frozen=True)
class Placement:
    """Where a request runs: ``slot``; ``source``: the idle slot whose resident conversation's
    first ``keep`` tokens ``slot`` copies to start from (None: no copy); ``reason``: why, for
    the log line; ``common``: the prompt's common prefix with ``slot``'s resident (None: not
    trusted), compared once here for the request's plan."""

    slot: int
    source: int | None = None
    keep: int = 0
    reason: str = ""
    common: int | None = None  # the prompt's common prefix with ``slot``'s trusted resident


def view_fit(view: SlotView, prompt: Sequence[int]) -> tuple[int, int]:
    """(common, usable): the prefix ``prompt`` shares with ``view``'s trusted resident
    conversation, and the part of it a request can keep (:func:`usable_prefix`)."""
    held = len(view.held_ids) if view.trusted else 0
    common = common_prefix_length(view.held_ids, prompt) if held else 0
    return common, usable_prefix(held, common, len(prompt), view.can_rewind, view.checkpoints)


def slot_rank(view: SlotView, prompt: Sequence[int], session_key: str | None,
              fit: tuple[int, int] | None = None) -> tuple:
    """The sort key of ``view`` for ``prompt`` (the best slot has the largest); fit: its
    :func:`view_fit` when the caller has it."""
    held = len(view.held_ids) if view.trusted else 0
    common, usable = view_fit(view, prompt) if fit is None else fit
    loses = held > usable
    if view.answer_start is not None and view.answer_start <= held:
        continues = common >= view.answer_start
    else:
        continues = usable >= FORK_SHARE * held
    regenerate = loses and common == len(prompt)
    same_session = session_key is not None and session_key == view.session_key
    return usable if continues or not loses else 0, not loses, regenerate, same_session, -view.last_used


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
    fits = {v.index: view_fit(v, prompt) for v in views}  # one comparison per slot
    ranks = {v.index: slot_rank(v, prompt, session_key, fits[v.index]) for v in views}
    shared = {v.index: fits[v.index][1] for v in views}
    chosen = max(views, key=lambda v: ranks[v.index])
    usable, intact = ranks[chosen.index][:2]
    own = shared[chosen.index]
    if intact:
        why = f"its resident kept ({own} tok usable)" if usable else "empty"
    elif usable:
        why = f"a fork of its resident ({own} tok kept)"
    else:
        why = f"every idle slot loses its resident; this one keeps {own} tok"
    common = fits[chosen.index][0] if chosen.trusted else None
    donors = [v for v in views if v.index != chosen.index and shared[v.index] > own]
    if not donors:
        return Placement(chosen.index, reason=why, common=common)
    donor = max(donors, key=lambda v: (shared[v.index], v.last_used))
    keep = shared[donor.index]
    return Placement(chosen.index, donor.index, keep,
                     f"{why}; copies {keep} tok of slot {donor.index}, which keeps its "
                     f"{len(donor.held_ids)} tok", common)
