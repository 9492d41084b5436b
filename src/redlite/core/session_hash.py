"""The session file checksum: XXH3-64 (``"xxh3:<16 hex>"``), or CRC-32 (``"crc32:<8 hex>"``)
for files of older builds, over the canonical header then the data section; computed
incrementally, in the caller's thread (:class:`Hasher`) or in a thread of its own while the
caller writes (:class:`HashWorker`; the hash releases the GIL)."""

from __future__ import annotations

import threading
import zlib

import xxhash


def checksum_of(canonical: bytes, chunks) -> str:
    """``"xxh3:<16 hex>"`` of the canonical header followed by the data ``chunks``."""
    h = xxhash.xxh3_64(canonical)
    for chunk in chunks:
        h.update(chunk)
    return f"xxh3:{h.intdigest():016x}"


class Hasher:
    """The file checksum computed incrementally: XXH3-64, or CRC-32 for older files."""

    def __init__(self, canonical: bytes, legacy: bool) -> None:
        self.legacy = legacy
        self.crc = zlib.crc32(canonical) if legacy else 0
        self.xxh = None if legacy else xxhash.xxh3_64(canonical)

    def update(self, data) -> None:
        if self.legacy:
            self.crc = zlib.crc32(data, self.crc)
        else:
            self.xxh.update(data)

    def hexdigest(self) -> str:
        return f"crc32:{self.crc:08x}" if self.legacy else f"xxh3:{self.xxh.intdigest():016x}"


class HashWorker:
    """A thread feeding buffers to a :class:`Hasher` in order (the hash releases the GIL, so
    it runs while the caller reads or writes the next buffer: on a quiet 2-core machine a
    restore then runs at ~95% of a plain read, against ~70% hashing in the caller's thread).
    ``put`` buffers must stay unchanged until ``finish`` (or ``stop``) returns."""

    def __init__(self, hasher: Hasher) -> None:
        import queue

        self._hasher, self._queue = hasher, queue.SimpleQueue()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="session-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if not self._error:
                try:
                    for data in item:
                        self._hasher.update(data)
                except BaseException as error:
                    self._error.append(error)

    def put(self, *buffers) -> None:
        """Queue ``buffers`` (one hand-over: fewer wake-ups than one call per buffer)."""
        self._queue.put(buffers)

    def stop(self) -> None:
        """Wait for the thread to end (the buffers it held are released); no digest, no error."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def finish(self) -> str:
        """The digest of everything put; raises what the hash raised."""
        self.stop()
        if self._error:
            raise self._error[0]
        return self._hasher.hexdigest()


_checksum, _Hasher, _HashWorker = checksum_of, Hasher, HashWorker  # the former private names
