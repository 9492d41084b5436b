"""The conversation state file's format: layout, constants, header parsing, compatibility.

Layout: a standard safetensors file (8-byte little-endian header length, JSON header, data);
it opens with the ``safetensors`` library. The header's ``__metadata__`` holds one key,
``"redlite"``, whose value is a JSON object::

    format "redlite-session", version 2 (1 is read too), fingerprint (engine.fingerprint()), dtype,
    tensor_format ("torch" | "numpy"), layout, n_past, held_ids [int], engine_meta {..},
    checkpoints [{position, turn_boundary, nbytes, meta, tensors: [names]}],
    created, last_used (s since the epoch), checksum "crc32:xxxxxxxx",
    since version 2: session (the client's session key or null), replay [exact-replay turns]

Tensor names: ``state.<name>`` for the engine snapshot, ``ckpt.<i>.<name>`` for checkpoint
payloads. The checksum (:mod:`redlite.core.session_hash`) covers the canonical JSON of the
metadata (without ``checksum``) and the tensor table (:func:`canonical_header`), followed by the
data section; it detects corruption (not tampering). Never pickle: tensors are raw
little-endian bytes. Writing: :mod:`redlite.core.session_write`; reading:
:mod:`redlite.core.session_read`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT = "redlite-session"
VERSION = 2
READ_VERSIONS = (1, 2)  # version 2 adds the optional ``session`` and ``replay`` keys
MAX_HEADER_BYTES = 100 << 20
WRITE_CHUNK = 8 << 20  # bytes per write (one huge write measured slower than 8 MiB ones)
READ_CHUNK = 8 << 20  # bytes per read into the engine's memory

_NUMPY_CODES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}
_TORCH_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                "bool": "BOOL"}
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}


#: reasons a sound file is refused: written by another model, dtype or format version
MISMATCH_REASONS = frozenset({"format", "version", "fingerprint", "dtype", "tensor-format"})


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


def canonical_header(meta: dict[str, Any], table: dict[str, Any]) -> bytes:
    """The checksummed header: metadata (without ``checksum``) and the tensor table."""
    return json.dumps([{k: v for k, v in meta.items() if k != "checksum"}, table],
                      sort_keys=True, separators=(",", ":")).encode()


def parse_header(raw_header: bytes, data_len: int) -> tuple[dict[str, Any], dict[str, Any]]:
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


# the names the other session modules used while they were one file
_canonical = canonical_header
_parse_header = parse_header
