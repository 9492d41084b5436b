"""The conversation state file: safetensors tensors plus JSON metadata, written atomically.

Layout: a standard safetensors file (8-byte little-endian header length, JSON header, data);
it opens with the ``safetensors`` library. The header's ``__metadata__`` holds one key,
``"redlite"``, whose value is a JSON object::

    format "redlite-session", version 2 (1 is read too), fingerprint (engine.fingerprint()), dtype,
    tensor_format ("torch" | "numpy"), layout, n_past, held_ids [int], engine_meta {..},
    checkpoints [{position, turn_boundary, nbytes, meta, tensors: [names]}],
    created, last_used (s since the epoch), checksum "crc32:xxxxxxxx",
    since version 2: session (the client's session key or null), replay [exact-replay turns]

Tensor names: ``state.<name>`` for the engine snapshot, ``ckpt.<i>.<name>`` for checkpoint
payloads. The checksum is XXH3-64 (``"xxh3:<16 hex>"``; files of older builds carry
``"crc32:<8 hex>"``, still read) of the canonical JSON of the metadata (without ``checksum``)
and the tensor table, followed by the data section; it detects corruption (not tampering).

Writing goes to a temporary file in the same directory named per process and call
(``.<name>.<pid>-<8 hex>.tmp``, so writers sharing a directory never touch each other's), mode
0600 (the file decodes to a whole conversation), fsynced, renamed over the target, and the
directory fsynced (POSIX rename atomicity). A file is written once and never rewritten in
place. Never pickle: tensors are raw little-endian bytes.

Reading validates the header structure (offsets cover the data section exactly, so a
truncated file is detected), the format version, fingerprint and dtype, then the checksum;
any failure raises :class:`SessionFileError` with a short ``reason``. The data section is
memory-mapped (private, copy-on-write) and the tensors are views of the mapping: no copy in
Python, and the checksum pass runs over the mapped pages (:meth:`StateFile.verify`, or in a
background thread with :meth:`StateFile.start_verify`, so that copying the tensors into the
engine and verifying them proceed together at the disk's speed). torch is imported only for
``tensor_format == "torch"`` files.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from redlite.core.private_files import open_private

FORMAT = "redlite-session"
VERSION = 2
READ_VERSIONS = (1, 2)  # version 2 adds the optional ``session`` and ``replay`` keys
MAX_HEADER_BYTES = 100 << 20
WRITE_CHUNK = 8 << 20  # bytes per write (one huge write measured slower than 8 MiB ones)

_NUMPY_CODES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}
_TORCH_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                "bool": "BOOL"}
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}


class SessionFileError(Exception):
    """A state file that cannot be used; ``reason`` is a short tag for the log line
    (``truncated``, ``corrupt-header``, ``checksum``, ``format``, ``version``, ``fingerprint``,
    ``dtype``, ``tensor-format``, ``io``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Expected:
    """What a file must match to be loaded into this engine."""

    fingerprint: str
    dtype: str
    tensor_format: str


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
        and verify the checksum over the whole file in the same pass (each block hashed just
        after it is read). Tensors without a target are hashed from the mapping. Returns the
        tensors with the targets in place of the mapped views. Raises SessionFileError
        (``checksum``, ``io``, or ``corrupt-header`` for a target that does not fit)."""
        self._fill(targets)
        self._check = None
        return {**self.tensors, **targets}

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


def _checksum(canonical: bytes, chunks) -> str:
    """``"xxh3:<16 hex>"`` of the canonical header followed by the data ``chunks``."""
    h = xxhash.xxh3_64(canonical)
    for chunk in chunks:
        h.update(chunk)
    return f"xxh3:{h.intdigest():016x}"


def _buffer(array: Any) -> tuple[str, list[int], memoryview]:
    """(safetensors dtype code, shape, raw bytes) of a CPU numpy array or torch tensor."""
    if isinstance(array, np.ndarray):
        array = np.ascontiguousarray(array)
        code = next((c for c, t in _NUMPY_CODES.items() if np.dtype(t) == array.dtype), None)
        if code is None:
            raise TypeError(f"unsupported numpy dtype {array.dtype}")
        return code, list(array.shape), memoryview(array.reshape(-1).view(np.uint8))
    import torch  # a torch tensor: torch is there

    tensor = array.detach().to("cpu").contiguous()
    code = _TORCH_CODES.get(str(tensor.dtype).removeprefix("torch."))
    if code is None:
        raise TypeError(f"unsupported torch dtype {tensor.dtype}")
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return code, list(tensor.shape), memoryview(raw)


def _canonical(meta: dict[str, Any], table: dict[str, Any]) -> bytes:
    """The checksummed header: metadata (without ``checksum``) and the tensor table."""
    return json.dumps([{k: v for k, v in meta.items() if k != "checksum"}, table],
                      sort_keys=True, separators=(",", ":")).encode()


def write_state_file(path: str | os.PathLike, meta: dict[str, Any], tensors: dict[str, Any],
                     opener=open_private) -> int:
    """Write ``tensors`` (name -> CPU array/tensor) and ``meta`` (JSON-serialisable; format,
    version and checksum are filled in) to ``path`` atomically. Returns the bytes written.

    Raises OSError (e.g. ENOSPC: the temporary file is removed, the target untouched) or
    TypeError for an unsupported dtype. The file is created 0600 (:mod:`redlite.core.private_files`);
    ``opener`` is for tests (fault injection).
    """
    path = Path(path)
    names = sorted(tensors)
    buffers = [_buffer(tensors[name]) for name in names]
    header: dict[str, Any] = {}
    offset = 0
    for name, (code, shape, raw) in zip(names, buffers):
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    meta = dict(meta, format=FORMAT, version=VERSION)
    canonical = _canonical(meta, header)
    # the checksum is known only after the data pass: a unique placeholder of the same length
    # is written first and replaced once the last chunk is written (before the rename)
    placeholder = f"xxh3:{secrets.token_hex(8)}"
    meta["checksum"] = placeholder
    header["__metadata__"] = {"redlite": json.dumps(meta, separators=(",", ":"))}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    at = 8 + encoded.index(placeholder.encode())
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    hasher = _HashWorker(_Hasher(canonical, legacy=False))  # hashes while we write
    try:
        with opener(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for _, _, raw in buffers:
                for begin in range(0, raw.nbytes, WRITE_CHUNK):
                    chunk = raw[begin:begin + WRITE_CHUNK]
                    hasher.put(chunk)
                    f.write(chunk)
            f.flush()
            final = hasher.finish().encode()
            if os.pwrite(f.fileno(), final, at) != len(final):
                raise OSError("short write of the checksum")
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        hasher.finish()
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return 8 + len(encoded) + offset


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parse_header(raw_header: bytes, data_len: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(redlite meta, tensor entries) of a safetensors header; validates offsets against
    ``data_len`` (None skips that check)."""
    try:
        header = json.loads(raw_header)
        meta = json.loads(header.pop("__metadata__")["redlite"])
    except (ValueError, KeyError, TypeError) as error:
        raise SessionFileError("corrupt-header", str(error)) from None
    if not isinstance(meta, dict) or not isinstance(header, dict):
        raise SessionFileError("corrupt-header", "not an object")
    spans = []
    for name, entry in header.items():
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            ok = code in _ITEM_BYTES and all(isinstance(s, int) and s >= 0 for s in shape) \
                and 0 <= begin <= end and end - begin == count * _ITEM_BYTES[code]
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise SessionFileError("corrupt-header", f"bad entry for tensor {name!r}")
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise SessionFileError("corrupt-header", "tensor data is not contiguous")
        position = end
    if data_len is not None and position != data_len:
        reason = "truncated" if data_len < position else "corrupt-header"
        raise SessionFileError(reason, f"data section of {data_len} bytes, header says {position}")
    return meta, header


def check_compatible(meta: dict[str, Any], expected: Expected) -> None:
    """Raise SessionFileError when ``meta`` is not this format/version/model/dtype."""
    if meta.get("format") != FORMAT:
        raise SessionFileError("format", f"format {meta.get('format')!r}")
    if meta.get("version") not in READ_VERSIONS:
        raise SessionFileError("version", f"version {meta.get('version')!r}, expected {VERSION}")
    if meta.get("fingerprint") != expected.fingerprint:
        raise SessionFileError("fingerprint", f"model {meta.get('fingerprint')!r}, "
                               f"this model is {expected.fingerprint!r}")
    if meta.get("dtype") != expected.dtype:
        raise SessionFileError("dtype", f"dtype {meta.get('dtype')!r}, expected {expected.dtype!r}")
    if meta.get("tensor_format") != expected.tensor_format:
        raise SessionFileError("tensor-format", f"{meta.get('tensor_format')!r}")


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
    meta, _ = _parse_header(raw_header, size - 8 - n)
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
    meta, entries = _parse_header(mapped[8:8 + n], size - 8 - n)
    check_compatible(meta, expected)
    base = 8 + n
    if base < size:
        mapped.madvise(mmap.MADV_WILLNEED, base & ~(mmap.PAGESIZE - 1))  # start reading ahead
    canonical = _canonical(meta, entries)
    stored = meta.get("checksum")

    def check() -> None:
        with memoryview(mapped) as view:
            data = view[base:]
            if isinstance(stored, str) and stored.startswith("crc32:"):  # older files
                computed = f"crc32:{zlib.crc32(data, zlib.crc32(canonical)):08x}"
            else:
                computed = _checksum(canonical, (data,))
            data.release()
        if stored != computed:
            raise SessionFileError("checksum", f"stored {stored}, computed {computed}")

    def fill(targets: dict[str, Any]) -> None:
        legacy = isinstance(stored, str) and stored.startswith("crc32:")
        # each block hashed right after it is read, while it is in the CPU cache (measured
        # faster than a hashing thread on the 2-core development machine)
        hasher = _Hasher(canonical, legacy)
        order = sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0])
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != size:
                    raise SessionFileError("changed", "file size changed")
                for name, entry in order:
                    begin, end = (base + o for o in entry["data_offsets"])
                    target = targets.get(name)
                    if target is None:
                        hasher.update(memoryview(mapped)[begin:end])
                        continue
                    _check_target(name, target, entry)
                    f.seek(begin)
                    for block in _blocks(target):
                        for at in range(0, len(block), WRITE_CHUNK):
                            piece = block[at:at + WRITE_CHUNK]
                            if _read_into(f, piece) != len(piece):
                                raise SessionFileError("truncated", "short read")
                            hasher.update(piece)
        except OSError as error:
            raise SessionFileError("io", str(error)) from None
        computed = hasher.hexdigest()
        if stored != computed:
            raise SessionFileError("checksum", f"stored {stored}, computed {computed}")

    tensors = {}
    for name, entry in entries.items():
        begin, end = entry["data_offsets"]
        tensors[name] = _array(mapped, base + begin, base + end, entry["dtype"], entry["shape"],
                               meta["tensor_format"])
    return StateFile(meta, tensors, size, check, fill)


class _Hasher:
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


class _HashWorker:
    """A thread feeding buffers to a :class:`_Hasher` in order (the hash releases the GIL, so
    it runs while the caller reads or writes the next buffer). ``put`` buffers must stay
    unchanged until ``finish`` returns the digest."""

    def __init__(self, hasher: _Hasher) -> None:
        import queue

        self._hasher, self._queue = hasher, queue.SimpleQueue()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="session-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if not self._error:
                try:
                    self._hasher.update(item)
                except BaseException as error:
                    self._error.append(error)

    def put(self, data) -> None:
        self._queue.put(data)

    def finish(self) -> str:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error:
            raise self._error[0]
        return self._hasher.hexdigest()


def _check_target(name: str, target: Any, entry: dict[str, Any]) -> None:
    """Raise SessionFileError unless ``target`` is a CPU torch tensor of the entry's shape and dtype."""
    code = _TORCH_CODES.get(str(getattr(target, "dtype", "")).removeprefix("torch."))
    if code != entry["dtype"] or list(target.shape) != list(entry["shape"]) \
            or getattr(target, "device", None) is None or target.device.type != "cpu":
        raise SessionFileError("corrupt-header", f"tensor {name!r} does not fit the engine's "
                               f"({entry['dtype']} {entry['shape']})")


def _blocks(target: Any):
    """Writable byte views of ``target``'s contiguous blocks, in row-major order (the file's
    order): the trailing dimensions that are contiguous form one block."""
    import itertools

    import torch

    shape, strides = list(target.shape), list(target.stride())
    k, expected = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    if target.numel() == 0:
        return
    for index in itertools.product(*(range(n) for n in shape[:k])):
        block = target[index] if index else target
        assert block.is_contiguous()  # a view, so reading into it fills the target
        yield memoryview(block.reshape(-1).view(torch.uint8).numpy())


def _read_into(f, view: memoryview) -> int:
    """Fill ``view`` from ``f``; returns the bytes read (less at end of file)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


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
