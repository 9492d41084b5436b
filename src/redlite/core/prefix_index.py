"""Find parked conversations that share a prefix with a prompt without comparing every one.

Each indexed sequence of token ids is cut into blocks of ``block`` tokens; block ``k`` (1-based)
gets a chain hash ``h_k = blake2b(h_{k-1} || ids of block k)``, so ``h_k`` names the first
``k * block`` tokens. The index maps ``(k, h_k)`` to the keys of the sequences whose first ``k``
blocks are exactly those tokens (as in vLLM's and SGLang's prefix caches).

A lookup returns the indexed keys in *groups*: the keys that share exactly ``k`` full blocks
with the prompt, deepest first. A key in group ``k`` has a common prefix ``c`` with the prompt
with ``k * block <= c < (k + 1) * block`` (barring a hash collision), so the caller verifies
the deepest groups by token comparison and stops once no shallower group can beat the best
found. A lookup costs no more than the prompt's blocks past those it is given hashes of (a
slot's held ids' hashes, :class:`redlite.core.sequence.Sequence`): where an indexed sequence
holds those blocks, one token comparison with it gives their hashes (its own); a block is
hashed only where the prompt leaves every indexed sequence. The deepest shared level and the
group bounds are found by binary search (the keys at level ``k`` include those at ``k + 1``).

Pure data structure: no engine, no I/O. Indexed sequences are kept by reference and never
changed by their owners.
"""

from __future__ import annotations

import hashlib
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
        self._levels: dict[tuple[int, bytes], set[Hashable]] = {}
        self._hashes: dict[Hashable, list[bytes]] = {}
        self._ids: dict[Hashable, Sequence[int]] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._hashes

    def keys(self) -> list[Hashable]:
        return list(self._hashes)

    def hashes_of(self, key: Hashable) -> list[bytes]:
        """The chain hashes ``key`` is indexed by (a copy; empty when absent)."""
        return list(self._hashes.get(key, ()))

    def hashes(self, ids: Sequence[int], known: Sequence[bytes] = ()) -> list[bytes]:
        """Every chain hash of ``ids`` (:func:`block_hashes`): ``known`` (its leading ones,
        when the caller has them), then those of indexed sequences sharing the next blocks,
        then the rest hashed."""
        chain = self._shared_chain(ids, known)
        if len(chain) < len(known):  # known past what the index shares
            chain = list(known[:len(ids) // self.block])
        return chain + list(block_hashes(ids, self.block, start=len(chain),
                                         previous=chain[-1] if chain else b""))

    def add(self, key: Hashable, ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> None:
        """Index ``ids`` (kept by reference: never changed afterwards) under ``key``
        (replacing what ``key`` indexed before); ``hashes``: :meth:`hashes` of ``ids`` when
        the caller has them."""
        self.remove(key)
        hashes = self.hashes(ids) if hashes is None else list(hashes)
        self._hashes[key], self._ids[key] = hashes, ids
        levels = self._levels
        for level in enumerate(hashes, start=1):
            members = levels.get(level)
            if members is None:
                levels[level] = {key}
            else:
                members.add(key)

    def remove(self, key: Hashable) -> None:
        """Forget ``key`` (no error when absent)."""
        self._ids.pop(key, None)
        levels = self._levels
        for level in enumerate(self._hashes.pop(key, []), start=1):
            members = levels.get(level)
            if members is not None:
                members.discard(key)
                if not members:
                    del levels[level]

    def lookup(self, prompt: Sequence[int], known: Sequence[bytes] = ()) -> list[CandidateGroup]:
        """Every indexed key, grouped by the number of full blocks it shares with ``prompt``,
        deepest group first (empty groups omitted). known: leading chain hashes of ``prompt``
        the caller has (any number; all of them: nothing is hashed)."""
        chain = self._shared_chain(prompt, known)
        everyone = set(self._hashes)

        def members(k: int) -> set[Hashable]:  # the keys sharing the prompt's first k blocks
            return self._levels.get((k, chain[k - 1]), set()) if k else everyone

        groups = []
        k, deeper = len(chain), set()
        while k >= 0:
            shared = members(k)
            if shared - deeper:
                groups.append(CandidateGroup(k, (k + 1) * self.block, sorted(shared - deeper, key=repr)))
            # the next shallower level with more keys (the count only grows towards level 0)
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi) // 2
                if len(members(mid)) > len(shared):
                    lo = mid + 1
                else:
                    hi = mid
            k, deeper = lo - 1, shared
        return groups

    def _shared_chain(self, ids: Sequence[int], known: Sequence[bytes]) -> list[bytes]:
        """The chain hashes of ``ids`` up to the deepest level an indexed key shares with it:
        a binary search in ``known``; past it, an indexed sequence's own hashes for the blocks
        it holds like ``ids`` (one token comparison), else one block hashed."""
        block, n_blocks = self.block, len(ids) // self.block
        known = known[:n_blocks]
        lo, hi = 0, len(known)  # level lo is shared (level 0: every key)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid, known[mid - 1]) in self._levels:
                lo = mid
            else:
                hi = mid - 1
        chain = list(known[:lo])
        if lo < len(known) or not self._hashes:
            return chain
        while len(chain) < n_blocks:
            k = len(chain)
            members = self._levels.get((k, chain[-1]), ()) if k else self._hashes
            holder = next((key for key in members if len(self._hashes[key]) > k), None)
            if holder is not None:
                common = common_prefix_length(self._ids[holder], ids, start=k * block)
                shared = min(common // block, len(self._hashes[holder]), n_blocks)
                if shared > k:
                    chain += self._hashes[holder][k:shared]
                    continue
            digest = next(block_hashes(ids, block, limit=k + 1, start=k, previous=chain[-1] if k else b""))
            if (k + 1, digest) not in self._levels:
                break
            chain.append(digest)
        return chain
