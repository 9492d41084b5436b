"""The state of one conversation held in one engine slot.

A :class:`Sequence` owns what must agree with its slot's engine state: the held token ids
(``len(held_ids) == engine.n_past`` whenever ``failed`` is False), the checkpoints taken on
them, whether that agreement can be trusted (``failed``: set while an engine call that changes
the state runs, and left set when it fails, so the next request resets), the conversation's
session key, how many requests reused it (``hits``), and where its last answer starts. Its
replay entries live in the exact-replay store, found by its held ids
(:mod:`redlite.core.replay`).

The :class:`~redlite.core.generation.Generator` serving the slot changes these fields (with
:mod:`redlite.core.live_state` and :mod:`redlite.core.forks` when a conversation moves in or
out); everything else reads them. The held ids change only by appending, by :meth:`Sequence.cut`
or by replacing the list: the prefix index's chain hashes of them (:meth:`Sequence.held_hashes`)
are kept across requests on that contract, so a request hashes only the blocks it added, and so
is the prompt they were last brought to (:meth:`Sequence.note_prompt`), so the same prompt list
again (a regenerate, from the render cache) is known to be held without comparing its ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from redlite.core.checkpoints import CheckpointStore
from redlite.core.prefix_index import block_hashes


@dataclass
class Sequence:
    """One slot's conversation (see module docstring). engine: the slot (an
    :class:`~redlite.engine.base.Engine`, or a proxy forwarding to one). last_used: when its
    last request ended (``time.monotonic`` seconds; placement evicts the least recent), set by
    :meth:`touch`; :attr:`used_at`: the same moment in seconds since the epoch. answer_start:
    where the last generated answer starts in ``held_ids`` (for the cache-miss log), None once
    ``held_ids`` is replaced as a whole."""

    engine: Any
    checkpoints: CheckpointStore
    held_ids: list[int] = field(default_factory=list)
    failed: bool = False
    session_key: str | None = None
    hits: int = 0
    answer_start: int | None = None
    last_used: float = field(default_factory=time.monotonic)
    # block -> chain hashes of held_ids' leading full blocks (see held_hashes)
    _chains: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # (prompt, n): the held ids start with prompt[:n] (see note_prompt)
    _prompt: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # held ids replaced as a whole (another conversation installed, copied or reset): the
        # answer start, the hashes and the noted prompt belonged to the old ones
        if name == "held_ids" and "held_ids" in self.__dict__:
            object.__setattr__(self, "answer_start", None)
            object.__setattr__(self, "_chains", {})
            object.__setattr__(self, "_prompt", None)
        object.__setattr__(self, name, value)

    def cut(self, keep: int) -> None:
        """Drop the held ids past ``keep`` (and the hashes of the blocks they were in)."""
        del self.held_ids[keep:]
        for block, chain in self._chains.items():
            del chain[keep // block:]
        if self._prompt is not None and self._prompt[1] > keep:
            self._prompt = (self._prompt[0], keep)

    def note_prompt(self, prompt: list[int]) -> None:
        """The held ids start with all of ``prompt`` now (its prefill is done); ``prompt`` is
        never changed in place (a request's prompt list)."""
        self._prompt = (prompt, len(prompt))

    def known_common(self, prompt: list[int]) -> int:
        """How many leading ids of ``prompt`` the held ids are known to hold without comparing:
        those of the list last given to :meth:`note_prompt` (the same object) still held, else 0
        (also when the last of them differs: held ids changed against the contract)."""
        noted = self._prompt
        if noted is None or noted[0] is not prompt:
            return 0
        n = min(noted[1], len(prompt), len(self.held_ids))
        return n if n and self.held_ids[n - 1] == prompt[n - 1] else 0

    def held_hashes(self, block: int, blocks: int | None = None) -> list[bytes]:
        """The chain hashes (:func:`~redlite.core.prefix_index.block_hashes`) of the first
        ``blocks`` full blocks of the held ids (None: all), in a new list; blocks are hashed
        once (kept until cut or replaced)."""
        chain = self._chains.setdefault(block, [])
        n = len(self.held_ids) // block if blocks is None else min(blocks, len(self.held_ids) // block)
        if len(chain) < n:
            chain += block_hashes(self.held_ids, block, limit=n, start=len(chain),
                                  previous=chain[-1] if chain else b"")
        return chain[:n]

    def know_hashes(self, block: int, hashes: list[bytes]) -> None:
        """The caller has the chain hashes of the held ids' leading blocks (an installed
        conversation's, from its index): kept as :meth:`held_hashes`' start."""
        if len(hashes) <= len(self.held_ids) // block and len(hashes) > len(self._chains.get(block, ())):
            self._chains[block] = list(hashes)

    def touch(self) -> None:
        """Mark the conversation used now (a request on it ended)."""
        self.last_used = time.monotonic()

    @property
    def used_at(self) -> float:
        """:attr:`last_used` in seconds since the epoch (what ``GET /v1/conversations`` shows,
        as for parked and stored conversations)."""
        return time.time() - (time.monotonic() - self.last_used)

