"""A tokenized text kept by its pieces, so a later text that starts the same way is tokenized
from the last shared piece on (see :mod:`redlite.loading.segment_encoder`).

The pieces of a text are cut right before each special token (the encoder's cut points); the
tokens of the text are those of its pieces, concatenated. So when a new text equals an earlier
one up to a cut point ``p`` of both, the new text's tokens are the earlier one's first
``counts[k]`` ids followed by the tokens of ``new[p:]``: an agent's next prompt (the whole
conversation again, plus the answer and a new message) is tokenized in time linear in what is
new, not in the conversation. Whether ``p`` is a cut point of the new text is the encoder's
check (:meth:`redlite.loading.segment_encoder.SegmentEncoder.encode_pieces`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Pieces:
    """A text and its token ids by piece (immutable: share, do not change).

    text: the text. ids: its token ids. starts: the character position where each piece
    starts (ascending, ``starts[0] == 0``). counts: the tokens before each piece.
    offsets: per piece, its tokens' (start, end) characters relative to the piece's start
    (int64 arrays of shape [tokens, 2]).
    """

    text: str
    ids: list[int]
    starts: list[int]
    counts: list[int]
    offsets: list[np.ndarray]

    def token_boundary(self, char: int) -> int | None:
        """The number of tokens that start before character ``char``, or None when a token
        straddles it (starts before it and ends after it)."""
        k = bisect.bisect_right(self.starts, char) - 1
        local = char - self.starts[k]
        rows = self.offsets[k]
        n = int(np.searchsorted(rows[:, 0], local, "left"))
        if n and int(rows[:n, 1].max()) > local:
            return None
        return self.counts[k] + n

    def shared_cut(self, text: str) -> tuple[int, int]:
        """``(k, char)``: the last of this text's cut points (piece starts, and its end as
        ``k == len(starts)``) up to which ``text`` equals this text; ``(0, 0)`` at least.
        Costs a comparison of about twice the shared part (galloping, then a binary search
        over the cut points)."""
        cuts = self.starts + [len(self.text)]
        if text.startswith(self.text):
            return len(cuts) - 1, len(self.text)
        lo, hi, step = 0, len(cuts) - 1, 1  # text agrees up to cuts[lo], not up to cuts[hi]
        while lo + step < hi:  # galloping first: a text that differs early costs little
            a, b = cuts[lo], cuts[lo + step]
            if text[a:b] != self.text[a:b]:
                hi = lo + step
                break
            lo, step = lo + step, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            a, b = cuts[lo], cuts[mid]
            if text[a:b] == self.text[a:b]:
                lo = mid
            else:
                hi = mid
        return lo, cuts[lo]

    def cut_count(self, char: int) -> int | None:
        """The tokens before character ``char`` when the ids split exactly there (a piece
        start or the end: the tokens of ``text[:char]`` and of ``text[char:]``, concatenated,
        are the ids), else None."""
        if char == len(self.text):
            return len(self.ids)
        k = bisect.bisect_left(self.starts, char)
        return self.counts[k] if k < len(self.starts) and self.starts[k] == char else None

    def count_at(self, k: int) -> int:
        """Tokens before cut point ``k`` (``k == len(starts)``: all)."""
        return self.counts[k] if k < len(self.counts) else len(self.ids)

    def continued(self, k: int, text: str, suffix: "Pieces") -> "Pieces":
        """The pieces of ``text``: this text's pieces before cut point ``k`` (which ``text``
        shares) and then ``suffix``, the pieces of ``text[char of k:]``."""
        char = self.starts[k] if k < len(self.starts) else len(self.text)
        count = self.count_at(k)
        ids = self.ids[:count]
        ids += suffix.ids
        return Pieces(text, ids,
                      self.starts[:k] + [char + s for s in suffix.starts],
                      self.counts[:k] + [count + c for c in suffix.counts],
                      self.offsets[:k] + suffix.offsets)


def offsets_boundary(offsets: np.ndarray) -> Callable[[int], int | None]:
    """char -> the tokens starting before it, None when a token straddles it (``offsets``: the
    tokens' char spans)."""
    starts = offsets[:, 0]
    reach = np.maximum.accumulate(offsets[:, 1]) if len(offsets) else offsets[:, 1]

    def boundary(chars: int) -> int | None:
        count = int(np.searchsorted(starts, chars, "left"))
        return None if count and reach[count - 1] > chars else count
    return boundary
