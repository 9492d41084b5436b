"""The C heap (glibc malloc) of a process serving on CPU: what it keeps and what it gives back.

:func:`reuse_freed_memory` (the engine's ``heap_reuse`` option, on by default) keeps freed
buffers for the next ones: without it glibc serves every buffer over its mmap threshold (at most
32 MB) with a fresh mapping and unmaps it on free, so each prefill chunk's activations and
products (tens of MB each) are page-faulted and zeroed by the kernel again, every chunk. The
cost: resident memory stays at the buffers' high-water mark after a prefill instead of falling
back.
:func:`release_free_heap` gives the free pages back once (after loading).
"""

from __future__ import annotations

import ctypes
import functools

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


@functools.lru_cache(maxsize=None)
def reuse_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse: no mapping of its own per large buffer
    (``M_MMAP_MAX`` 0), no trimming of the heap's top on free (``M_TRIM_THRESHOLD`` 2 GiB) and
    one arena for threads that allocate from now on (``M_ARENA_MAX`` 1; a thread's own arena
    would map any buffer over 64 MB anyway). Process-wide and once; returns False where the C
    library has no ``mallopt`` or refuses a setting."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1)))


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``): loading frees
    tens of MB of transient buffers (the tokenizer's JSON, weight tables) that glibc would
    otherwise keep resident. False where the C library has no ``malloc_trim``."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
