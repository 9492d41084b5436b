"""Find parked conversations that share a prefix with a prompt without comparing every one.

Each indexed sequence of token ids is cut into blocks of ``block`` tokens; block ``k`` (1-based)
gets a chain hash ``h_k = blake2b(h_{k-1} || ids of block k)``, so ``h_k`` names the first
``k * block`` tokens. The index maps ``(k, h_k)`` to the keys of the sequences whose first ``k``
blocks are exactly those tokens (as in vLLM's and SGLang's prefix caches).

A lookup hashes the prompt block by block, stopping at the first block no sequence shares, and
returns the indexed keys in *groups*: the keys that share exactly ``k`` full blocks with the
prompt, deepest first. A key in group ``k`` has a common prefix ``c`` with the prompt with
``k * block <= c < (k + 1) * block`` (barring a hash collision), so the caller verifies the
deepest groups by token comparison and stops once no shallower group can beat the best found.

Pure data structure: no engine, no I/O.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from array import array
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

from redlite.core.reuse import common_prefix_length

DEFAULT_BLOCK = 128


def block_hashes(ids: Sequence[int], block: int, limit: int | None = None, start: int = 0,
                 previous: bytes = b"") -> Iterator[bytes]:
    """Chain hashes (16-byte digests) of the full blocks of ``ids``, block 1 first.

    limit: the most blocks to hash (None: all full blocks). Token ids are hashed as
    little-endian signed 64-bit integers. start, previous: go on after the first ``start``
    blocks, whose last hash is ``previous``.
    """
    n_blocks = len(ids) // block
    if limit is not None:
        n_blocks = min(n_blocks, limit)
    for k in range(start, n_blocks):
        chunk = array("q", ids[k * block:(k + 1) * block]).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        yield previous


class HashMemo:
    """The chain hashes of the last ``size`` sequences hashed: a sequence that shares leading
    blocks with one of them hashes only the blocks past those (a conversation's next prompt and
    its held ids share all but the newest tokens). Costs a token comparison per remembered
    sequence, in C. Thread-safe."""

    def __init__(self, block: int, size: int = 4) -> None:
        self.block = block
        self._recent: collections.deque[tuple[list[int], list[bytes]]] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def known(self, ids: Sequence[int]) -> list[bytes]:
        """The hashes of the leading blocks of ``ids`` that a remembered sequence holds."""
        with self._lock:
            recent = list(self._recent)
        n_blocks = len(ids) // self.block
        best: list[bytes] = []
        for seq, hashes in recent:
            if len(hashes) <= len(best):  # cannot share more blocks than the best found
                continue
            shared = min(common_prefix_length(seq, ids) // self.block, n_blocks)
            if shared > len(best):
                best = hashes[:shared]
            if len(best) == n_blocks:
                break
        return best

    def chain(self, ids: Sequence[int]) -> Iterator[bytes]:
        """:func:`block_hashes` of ``ids``, the known ones first (lazily: a caller may stop)."""
        known = self.known(ids)
        yield from known
        yield from block_hashes(ids, self.block, start=len(known), previous=known[-1] if known else b"")

    def hashes(self, ids: Sequence[int]) -> list[bytes]:
        """Every chain hash of ``ids``; ``ids`` is remembered."""
        out = list(self.chain(ids))
        if out:
            with self._lock:
                self._recent.appendleft((list(ids[:len(out) * self.block]), out))
        return out


@dataclass(frozen=True)
class CandidateGroup:
    """Keys sharing exactly ``blocks`` full blocks with the prompt: their common prefix with
    it is at least ``blocks * block`` and below ``bound`` tokens."""

    blocks: int
    bound: int
    keys: list[Hashable]


class PrefixIndex:
    """Index of token sequences by chain hashes of their leading blocks (see module docstring).

    block: tokens per block (>= 1). Keys are any hashable ids chosen by the caller.
    """

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        if block < 1:
            raise ValueError("block must be >= 1")
        self.block = block
        self._memo = HashMemo(block)
        self._levels: dict[tuple[int, bytes], set[Hashable]] = {}
        self._hashes: dict[Hashable, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._hashes

    def keys(self) -> list[Hashable]:
        return list(self._hashes)

    def hashes(self, ids: Sequence[int]) -> list[bytes]:
        """The chain hashes of ``ids`` (:func:`block_hashes`, through a :class:`HashMemo`), to
        pass to several calls about the same sequence."""
        return self._memo.hashes(ids)

    def add(self, key: Hashable, ids: Sequence[int], hashes: list[bytes] | None = None) -> None:
        """Index ``ids`` under ``key`` (replacing what ``key`` indexed before); ``hashes``:
        :meth:`hashes` of ``ids`` when the caller has them."""
        self.remove(key)
        hashes = self.hashes(ids) if hashes is None else hashes
        self._hashes[key] = hashes
        for k, digest in enumerate(hashes, start=1):
            self._levels.setdefault((k, digest), set()).add(key)

    def remove(self, key: Hashable) -> None:
        """Forget ``key`` (no error when absent)."""
        for k, digest in enumerate(self._hashes.pop(key, []), start=1):
            members = self._levels.get((k, digest))
            if members is not None:
                members.discard(key)
                if not members:
                    del self._levels[(k, digest)]

    def lookup(self, prompt: Sequence[int], hashes: list[bytes] | None = None) -> list[CandidateGroup]:
        """Every indexed key, grouped by the number of full blocks it shares with ``prompt``,
        deepest group first (empty groups omitted). Cost: one hash per shared block not known
        to the :class:`HashMemo` (none when ``hashes``, :meth:`hashes` of ``prompt``, are given)."""
        matched: list[set[Hashable]] = [set(self._hashes)]  # level 0: every key
        chain = self._memo.chain(prompt) if hashes is None else hashes
        for k, digest in enumerate(chain, start=1):
            members = self._levels.get((k, digest))
            if not members:
                break
            matched.append(members)
        groups = []
        deeper: set[Hashable] = set()
        for k in range(len(matched) - 1, -1, -1):
            exact = matched[k] - deeper
            if exact:
                groups.append(CandidateGroup(k, (k + 1) * self.block, sorted(exact, key=repr)))
            deeper = matched[k]
        return groups
