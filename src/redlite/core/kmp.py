"""The Knuth-Morris-Pratt prefix function, shared by the stop scanner and the echo engine."""

from __future__ import annotations

from typing import Sequence


def prefix_function(pattern: Sequence) -> list[int]:
    """``pi[i]``: the length of the longest proper prefix of ``pattern[:i + 1]`` that is also a
    suffix of it (a ``str``, ``bytes`` or any indexable sequence of comparable items)."""
    pi = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = pi[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        pi[i] = k
    return pi
