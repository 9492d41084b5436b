"""Writing a conversation state file (format: :mod:`redlite.core.session_format`) atomically.

Writing goes to a temporary file in the same directory named per process and call
(``.<name>.<pid>-<8 hex>.tmp``, so writers sharing a directory never touch each other's), mode
0600 (the file decodes to a whole conversation), in ``WRITE_CHUNK`` writes straight from the
tensors' memory (hashed by a thread meanwhile), fsynced, renamed over the target, and the
directory fsynced (POSIX rename atomicity). A file is written once and never rewritten in place.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any

import numpy as np

from redlite.core.private_files import open_private
from redlite.core.session_format import (_NUMPY_CODES, _TORCH_CODES, FORMAT, VERSION, WRITE_CHUNK,
                                         canonical_header)
from redlite.core.session_hash import Hasher, HashWorker


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
    canonical = canonical_header(meta, header)
    # the checksum is known only after the data pass: a unique placeholder of the same length
    # is written first and replaced once the last chunk is written (before the rename)
    placeholder = f"xxh3:{secrets.token_hex(8)}"
    meta["checksum"] = placeholder
    header["__metadata__"] = {"redlite": json.dumps(meta, separators=(",", ":"))}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    at = 8 + encoded.index(placeholder.encode())
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    hasher = HashWorker(Hasher(canonical, legacy=False))  # hashes while we write
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
        hasher.stop()
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
