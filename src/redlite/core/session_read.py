"""Reading a conversation state file (format: :mod:`redlite.core.session_format`).

Reading validates the header structure (offsets cover the data section exactly, so a
truncated file is detected), the format version, fingerprint and dtype, then the checksum;
any failure raises :class:`SessionFileError` with a short ``reason``. The data section is
memory-mapped (private, copy-on-write) and the tensors are views of the mapping: no copy in
Python, and the checksum pass runs over the mapped pages (:meth:`StateFile.verify`, or in a
background thread with :meth:`StateFile.start_verify`, so that copying the tensors into the
engine and verifying them proceed together at the disk's speed), or the data are read straight
into the engine's buffers (scatter reads of up to ``READ_CHUNK`` bytes) while a thread hashes
the previous batch (:meth:`StateFile.fill`). torch is imported
only for ``tensor_format == "torch"`` files.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from redlite.core.session_format import (_ITEM_BYTES, _NUMPY_CODES, _TORCH_CODES, MAX_HEADER_BYTES,
                                         READ_CHUNK, Expected, SessionFileError, canonical_header,
                                         check_compatible, parse_header)
from redlite.core.session_hash import Hasher, HashWorker, checksum_of


@dataclass
class StateFile:
    """A file's content: ``meta`` (the JSON object), ``tensors`` (name -> array/tensor on CPU,
    views of the file's private mapping) and ``nbytes`` (the file size). Until :meth:`verify`
    has returned, the tensors are unverified bytes."""

    meta: dict[str, Any]
    tensors: dict[str, Any]
    nbytes: int
    _check: Any = field(default=None, repr=False)  # () -> None, raises SessionFileError
    _fill: Any = field(default=None, repr=False)  # (targets) -> None, see fill()
    _thread: threading.Thread | None = field(default=None, repr=False)
    _error: list = field(default_factory=list, repr=False)

    def start_verify(self) -> None:
        """Start the checksum pass in a background thread (the hash releases the GIL)."""
        if self._check is None or self._thread is not None:
            return

        def run() -> None:
            try:
                self._check()
            except SessionFileError as error:
                self._error.append(error)
            except BaseException as error:  # e.g. an I/O error on a mapped page
                self._error.append(SessionFileError("io", str(error)))
        self._thread = threading.Thread(target=run, name="session-verify", daemon=True)
        self._thread.start()

    def fill(self, targets: dict[str, Any]) -> dict[str, Any]:
        """Read the data section straight into ``targets`` (name -> writable CPU torch tensor
        of that file tensor's shape and dtype, any strides: e.g. views of an engine's cache)
        and verify the checksum over the whole file in the same pass (each batch of blocks hashed
        by a thread while the next is read). Tensors without a target are hashed from the mapping. Returns the
        tensors with the targets in place of the mapped views (``tensors`` too: the mapping is
        unmapped as soon as no tensor views it). Call once. Raises SessionFileError
        (``checksum``, ``io``, or ``corrupt-header`` for a target that does not fit)."""
        self._fill(targets)
        self._check = self._fill = None
        self.tensors = {**self.tensors, **targets}
        return self.tensors

    def verify(self) -> None:
        """Finish the checksum pass (waits for :meth:`start_verify`'s thread). Raises
        SessionFileError (``checksum``) when the data are not what was written."""
        if self._check is None:
            return
        if self._thread is None:
            self._check()
        else:
            self._thread.join()
            if self._error:
                raise self._error[0]
        self._check = None


def read_meta(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(metadata, file size in bytes) from the header alone (for indexing a directory).
    Structure and sizes are checked; the checksum is not (see :func:`read_state_file`)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SessionFileError("truncated", "shorter than 8 bytes")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise SessionFileError("truncated" if n <= MAX_HEADER_BYTES else "corrupt-header",
                                       f"header of {n} bytes in a file of {size}")
            raw_header = f.read(n)
    except OSError as error:
        raise SessionFileError("io", str(error)) from None
    meta, _ = parse_header(raw_header, size - 8 - n)
    return meta, size


def read_state_file(path: str | os.PathLike, expected: Expected) -> StateFile:
    """Read and verify a whole file: structure, compatibility with ``expected``, checksum.
    Returns CPU tensors (numpy arrays or torch tensors per the file's ``tensor_format``).
    Raises SessionFileError."""
    state = open_state_file(path, expected)
    state.verify()
    return state


def open_state_file(path: str | os.PathLike, expected: Expected) -> StateFile:
    """Map a file and check its structure and compatibility with ``expected``; the checksum
    is left to :meth:`StateFile.verify` / :meth:`StateFile.start_verify` (call one before
    trusting the tensors). Raises SessionFileError."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SessionFileError("truncated", "shorter than 8 bytes")
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except OSError as error:
        raise SessionFileError("io", str(error)) from None
    (n,) = struct.unpack_from("<Q", mapped, 0)
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise SessionFileError("truncated" if n <= MAX_HEADER_BYTES else "corrupt-header",
                               f"header of {n} bytes in a file of {size}")
    meta, entries = parse_header(mapped[8:8 + n], size - 8 - n)
    check_compatible(meta, expected)
    base = 8 + n

    def prefetch(begin: int, end: int) -> None:
        """Start reading ``[begin, end)`` of the mapping ahead (for the mapped path only: a
        whole-file read-ahead would compete with :meth:`StateFile.fill`'s own reads)."""
        if begin < end:
            start = begin & ~(mmap.PAGESIZE - 1)
            mapped.madvise(mmap.MADV_WILLNEED, start, end - start)
    canonical = canonical_header(meta, entries)
    stored = meta.get("checksum")

    def check() -> None:
        prefetch(base, size)
        with memoryview(mapped) as view:
            data = view[base:]
            if isinstance(stored, str) and stored.startswith("crc32:"):  # older files
                computed = f"crc32:{zlib.crc32(data, zlib.crc32(canonical)):08x}"
            else:
                computed = checksum_of(canonical, (data,))
            data.release()
        if stored != computed:
            raise SessionFileError("checksum", f"stored {stored}, computed {computed}")

    def fill(targets: dict[str, Any]) -> None:
        legacy = isinstance(stored, str) and stored.startswith("crc32:")
        hasher = HashWorker(Hasher(canonical, legacy))  # hashes a batch while the next is read
        order = sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0])
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != size:
                    raise SessionFileError("changed", "file size changed")
                for name, entry in order:
                    begin, end = (base + o for o in entry["data_offsets"])
                    target = targets.get(name)
                    if target is None:
                        prefetch(begin, end)
                        hasher.put(memoryview(mapped)[begin:end])
                        continue
                    _check_target(name, target, entry)
                    for batch in _batches(_blocks(target), READ_CHUNK):
                        begin += _read_batch(f.fileno(), batch, begin)
                        hasher.put(*batch)
        except BaseException as error:
            hasher.stop()
            if isinstance(error, OSError):
                raise SessionFileError("io", str(error)) from None
            raise
        computed = hasher.finish()
        if stored != computed:
            raise SessionFileError("checksum", f"stored {stored}, computed {computed}")

    tensors = {}
    for name, entry in entries.items():
        begin, end = entry["data_offsets"]
        tensors[name] = _array(mapped, base + begin, base + end, entry["dtype"], entry["shape"],
                               meta["tensor_format"])
    return StateFile(meta, tensors, size, check, fill)


def _check_target(name: str, target: Any, entry: dict[str, Any]) -> None:
    """Raise SessionFileError unless ``target`` is a CPU torch tensor of the entry's shape and dtype."""
    code = _TORCH_CODES.get(str(getattr(target, "dtype", "")).removeprefix("torch."))
    if code != entry["dtype"] or list(target.shape) != list(entry["shape"]) \
            or getattr(target, "device", None) is None or target.device.type != "cpu":
        raise SessionFileError("corrupt-header", f"tensor {name!r} does not fit the engine's "
                               f"({entry['dtype']} {entry['shape']})")


def _blocks(target: Any):
    """Writable byte views of ``target``'s contiguous blocks, in row-major order (the file's
    order): the trailing dimensions that are contiguous form one block. Views of one byte view
    of the whole storage, so a block costs a slice, not a tensor."""
    import itertools

    import torch

    shape, strides = list(target.shape), list(target.stride())
    k, per_block = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == per_block):
        per_block *= shape[k - 1]
        k -= 1
    if target.numel() == 0:
        return
    item = target.element_size()
    storage = torch.empty(0, dtype=torch.uint8, device="cpu").set_(target.untyped_storage())
    whole = memoryview(storage.numpy())
    length = per_block * item
    for index in itertools.product(*(range(n) for n in shape[:k])):
        start = (target.storage_offset() + sum(i * s for i, s in zip(index, strides))) * item
        yield whole[start:start + length]


def _batches(blocks, limit: int):
    """Lists of consecutive pieces of ``blocks`` (byte views) of at most ``limit`` bytes in all
    (a block over ``limit`` is cut), in order."""
    batch, total = [], 0
    for block in blocks:
        for at in range(0, len(block), limit):
            piece = block[at:at + limit]
            if batch and total + len(piece) > limit:
                yield batch
                batch, total = [], 0
            batch.append(piece)
            total += len(piece)
    if batch:
        yield batch


def _read_batch(fd: int, pieces: list, offset: int) -> int:
    """Fill ``pieces`` in order from ``fd`` at ``offset`` (one scatter read, ``preadv``, and
    more calls only after a short one). Returns the bytes read; raises SessionFileError
    (``truncated``) at end of file."""
    total = sum(len(p) for p in pieces)
    done = os.preadv(fd, pieces, offset)
    while done < total:  # a short read: continue from the byte it stopped at
        skip, rest = done, []
        for p in pieces:
            if skip >= len(p):
                skip -= len(p)
                continue
            rest.append(p[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + done)
        if n <= 0:
            raise SessionFileError("truncated", "short read")
        done += n
    return total


def _array(data: Any, begin: int, end: int, code: str, shape: list[int], tensor_format: str) -> Any:
    if tensor_format == "numpy":
        if code not in _NUMPY_CODES:
            raise SessionFileError("corrupt-header", f"dtype {code} in a numpy file")
        dtype = np.dtype(_NUMPY_CODES[code])
        if end == begin:
            return np.empty(shape, dtype)
        return np.frombuffer(data, dtype, (end - begin) // dtype.itemsize, begin).reshape(shape)
    import torch

    names = {v: k for k, v in _TORCH_CODES.items()}
    if code not in names:
        raise SessionFileError("corrupt-header", f"dtype {code} in a torch file")
    dtype = getattr(torch, names[code])
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=(end - begin) // _ITEM_BYTES[code],
                            offset=begin).reshape(shape)
