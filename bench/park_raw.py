"""The raw disk anchor of bench/park.py and the page-cache tools it needs: the same bytes moved
between the same kinds of memory in the session reader's and writer's pattern (8 MiB writes and
fsync; 8 MiB ``readinto`` into a full-size buffer already touched), with no format, checksum
or bookkeeping; dropping a file from the page cache and measuring how much of it is resident."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

BLOCK = 8 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def drop_cache(path: Path) -> None:
    """Write ``path`` back (fsync) and drop its pages from the page cache (``DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: Path) -> float:
    """Fraction of ``path``'s pages in the page cache now (``mincore`` of a mapping)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        address = _map_address(m)
        if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec) / pages
    finally:
        m.close()


def _map_address(m: mmap.mmap) -> int:
    """Start address of a read-only mapping (through the buffer protocol, no copy)."""
    import numpy as np

    array = np.frombuffer(m, dtype=np.uint8)
    address = array.ctypes.data
    del array
    return address


def raw_write(path: Path, source: memoryview) -> float:
    """Seconds to write all of ``source`` (a full-size buffer already in memory, as a parked
    state is) to a new file in ``BLOCK`` writes, fsync included: the session writer's pattern."""
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for begin in range(0, len(source), BLOCK):
            f.write(source[begin:begin + BLOCK])
        os.fsync(f.fileno())
    return time.perf_counter() - started


def raw_read(path: Path, target: memoryview) -> float:
    """Seconds to read the whole file into the start of ``target`` (a buffer at least as large,
    already touched, as an engine's cache is) in ``BLOCK`` ``readinto`` calls: the session
    reader's pattern."""
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size > len(target):
            raise ValueError(f"a file of {size} bytes does not fit a buffer of {len(target)}")
        target = target[:size]
        for begin in range(0, size, BLOCK):
            view = target[begin:begin + BLOCK]
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError("short read")
                got += n
    return time.perf_counter() - started


def full_buffers(nbytes: int, spare: int = 1 << 20) -> tuple[memoryview, memoryview]:
    """(random source of ``nbytes``, target of ``nbytes + spare``: room for files a little
    larger), every page touched before timing."""
    import numpy as np

    source = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    target = np.ones(nbytes + spare, dtype=np.uint8)
    return memoryview(source), memoryview(target)
