"""The conversation state file: safetensors tensors plus JSON metadata, written atomically.

Layout: a standard safetensors file (8-byte little-endian header length, JSON header, data);
it opens with the ``safetensors`` library. The header's ``__metadata__`` holds one key,
``"redlite"``, whose value is a JSON object::

    format "redlite-session", version 1, fingerprint (engine.fingerprint()), dtype,
    tensor_format ("torch" | "numpy"), layout, n_past, held_ids [int], engine_meta {..},
    checkpoints [{position, turn_boundary, nbytes, meta, tensors: [names]}],
    created, last_used (s since the epoch), checksum "crc32:xxxxxxxx"

Tensor names: ``state.<name>`` for the engine snapshot, ``ckpt.<i>.<name>`` for checkpoint
payloads. The checksum is CRC-32 of the canonical JSON of the metadata (without
``checksum``) and the tensor table, followed by the data section; it detects corruption (not
tampering). Writing goes to a
temporary file in the same directory, is fsynced, renamed over the target, and the directory
fsynced (POSIX rename atomicity). Never pickle: tensors are raw little-endian bytes.

Reading validates the header structure (offsets cover the data section exactly, so a
truncated file is detected), the format version, fingerprint and dtype, then the checksum;
any failure raises :class:`SessionFileError` with a short ``reason``. torch is imported only
for ``tensor_format == "torch"`` files.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from redlite.core.private_files import open_private

FORMAT = "redlite-session"
VERSION = 1
MAX_HEADER_BYTES = 100 << 20

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
    """A file's content: ``meta`` (the JSON object), ``tensors`` (name -> array/tensor on CPU)
    and ``nbytes`` (the file size)."""

    meta: dict[str, Any]
    tensors: dict[str, Any]
    nbytes: int


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
    crc = zlib.crc32(_canonical(meta, header))
    for _, _, raw in buffers:
        crc = zlib.crc32(raw, crc)
    meta["checksum"] = f"crc32:{crc:08x}"
    header["__metadata__"] = {"redlite": json.dumps(meta, separators=(",", ":"))}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with opener(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for _, _, raw in buffers:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
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
    if meta.get("version") != VERSION:
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
    try:
        with open(path, "rb", buffering=0) as f:
            data = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)  # not zero-filled
            got = _read_into(f, memoryview(data))
    except OSError as error:
        raise SessionFileError("io", str(error)) from None
    if got != len(data) or len(data) < 8:
        raise SessionFileError("truncated", "short read")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise SessionFileError("truncated" if n <= MAX_HEADER_BYTES else "corrupt-header",
                               f"header of {n} bytes in a file of {len(data)}")
    meta, entries = _parse_header(data[8:8 + n].tobytes(), len(data) - 8 - n)
    check_compatible(meta, expected)
    view = memoryview(data)[8 + n:]
    crc = zlib.crc32(view, zlib.crc32(_canonical(meta, entries)))
    if meta.get("checksum") != f"crc32:{crc:08x}":
        raise SessionFileError("checksum", f"stored {meta.get('checksum')}, computed crc32:{crc:08x}")
    base = 8 + n
    tensors = {}
    for name, entry in entries.items():
        begin, end = entry["data_offsets"]
        tensors[name] = _array(data, base + begin, base + end, entry["dtype"], entry["shape"],
                               meta["tensor_format"])
    return StateFile(meta, tensors, len(data))


def _read_into(f, view: memoryview) -> int:
    """Fill ``view`` from ``f``; returns the bytes read (less at end of file)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _array(data: np.ndarray, begin: int, end: int, code: str, shape: list[int], tensor_format: str) -> Any:
    if tensor_format == "numpy":
        if code not in _NUMPY_CODES:
            raise SessionFileError("corrupt-header", f"dtype {code} in a numpy file")
        dtype = np.dtype(_NUMPY_CODES[code])
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
