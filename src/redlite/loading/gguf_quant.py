"""GGUF quantized blocks -> 4-bit integer parts, exactly (the input of the int4 kernels).

A quantized GGUF tensor of shape ``[rows, cols]`` stores each row as blocks of 32 or 256
values. :class:`QuantizedTensor` keeps the raw block bytes (a view of the memory-mapped file,
rows already in Hugging Face order) and offers two ways to read them:

* :meth:`QuantizedTensor.dequantize`: float32 ``[rows, cols]`` through ``gguf.quants``
  (the reference, used where no quantized kernel applies);
* :meth:`QuantizedTensor.int4_parts`: the same values as a sum of 4-bit parts,
  ``w = sum_p codes_p * scale_p + offset`` with ``codes_p`` uint8 in ``0..15`` ``[rows, cols]``
  and ``scale_p``/``offset`` float32 per group of 32 columns ``[rows, cols // 32]``, or None
  for a format with no such form.

Block layouts are ggml's (``ggml-quants.c`` ``dequantize_row_*``); the decomposition per format:

==========  ==============================================  =====  ===========================
format      ggml value                                      parts  float32 result
==========  ==============================================  =====  ===========================
Q4_0        ``d * (q - 8)``                                 1      identical (no rounding)
Q4_1        ``d * q + m``                                   1      identical (same rounding)
Q8_0        ``d * q``, q int8 = ``lo + 16 hi - 128``        2      identical (no rounding)
Q4_K        ``d*sc * q - dmin*m`` per 32-value sub-block    1      identical (same rounding)
Q5_K        as Q4_K with ``q = lo + 16 * hi_bit``           2      within 1 ulp (two roundings)
==========  ==============================================  =====  ===========================

Q6_K (sub-blocks of 16 values: the int4 kernels take groups of >= 32) and the other formats
return None. :func:`ggml_half` reads the fp16 scale fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Formats :meth:`QuantizedTensor.int4_parts` decomposes (number of parts each).
INT4_FORMATS = {"Q4_0": 1, "Q4_1": 1, "Q8_0": 2, "Q4_K": 1, "Q5_K": 2}
GROUP = 32

Part = tuple[np.ndarray, np.ndarray]  # (codes uint8 [rows, cols], scale float32 [rows, cols // 32])


@dataclass
class QuantizedTensor:
    """A GGUF tensor kept in its file format.

    ``qtype``: the ``gguf.GGMLQuantizationType`` name (``"Q4_1"``); ``shape``: ``(rows, cols)``
    in Hugging Face order; ``data``: uint8 ``[rows, bytes per row]`` (a memory-map view).
    """

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]`` (``gguf.quants.dequantize``; the reference values)."""
        import gguf
        from gguf.quants import dequantize

        kind = gguf.GGMLQuantizationType[self.qtype]
        return np.asarray(dequantize(np.asarray(self.data), kind), dtype=np.float32).reshape(self.shape)

    def int4_parts(self) -> tuple[list[Part], np.ndarray] | None:
        """``(parts, offset)`` with ``w = sum(codes * scale) + offset`` per group of 32
        columns (see the module docstring), or None when the format has no 4-bit form or
        ``cols`` is not a multiple of 32."""
        decode = _DECODERS.get(self.qtype)
        if decode is None or self.shape[1] % GROUP:
            return None
        rows, cols = self.shape
        return decode(np.asarray(self.data), rows, cols)

    def rows(self, index: np.ndarray) -> "QuantizedTensor":
        """The tensor of the rows ``index`` (a permutation or selection; blocks run along
        rows, so this is exact on the bytes)."""
        return QuantizedTensor(self.qtype, (len(index), self.shape[1]), np.ascontiguousarray(self.data[index]))


def ggml_half(raw: np.ndarray) -> np.ndarray:
    """float32 of little-endian fp16 fields: ``raw`` uint8 ``[..., 2]`` -> ``[...]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, rows: int, size: int) -> np.ndarray:
    return data.reshape(rows, -1, size)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 ``[..., n]`` -> ``[..., 2n]``: the low nibbles, then the high ones (ggml's order
    for a 32-value sub-block pair)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_0(data: np.ndarray, rows: int, cols: int):
    b = _blocks(data, rows, 18)
    d = ggml_half(b[..., 0:2])
    codes = _nibbles(b[..., 2:18]).reshape(rows, cols)
    return [(codes, d)], -8 * d


def _q4_1(data: np.ndarray, rows: int, cols: int):
    b = _blocks(data, rows, 20)
    d, m = ggml_half(b[..., 0:2]), ggml_half(b[..., 2:4])
    return [(_nibbles(b[..., 4:20]).reshape(rows, cols), d)], m


def _q8_0(data: np.ndarray, rows: int, cols: int):
    b = _blocks(data, rows, 34)
    d = ggml_half(b[..., 0:2])
    u = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(rows, cols)
    return [(u & 15, d), (u >> 4, 16 * d)], -128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (d * sc, dmin * m) float32 ``[rows, blocks, 8]`` (ggml ``get_scale_min_k4``)."""
    d, dmin = ggml_half(b[..., 0:2]), ggml_half(b[..., 2:4])
    s = b[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return d[..., None] * sc.astype(np.float32), dmin[..., None] * mn.astype(np.float32)


def _q4_k(data: np.ndarray, rows: int, cols: int):
    b = _blocks(data, rows, 144)
    scale, minimum = _k_scales(b)
    qs = b[..., 16:144].reshape(rows, -1, 4, 32)  # 4 pairs of 32-value sub-blocks
    codes = _nibbles(qs).reshape(rows, cols)
    return [(codes, scale.reshape(rows, -1))], -minimum.reshape(rows, -1)


def _q5_k(data: np.ndarray, rows: int, cols: int):
    b = _blocks(data, rows, 176)
    scale, minimum = _k_scales(b)
    qh = b[..., 16:48]  # [rows, blocks, 32]: bit i of byte l is the high bit of sub-block i, value l
    qs = b[..., 48:176].reshape(rows, -1, 4, 32)
    low = _nibbles(qs).reshape(rows, cols)
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(rows, cols)
    scale = scale.reshape(rows, -1)
    return [(low, scale), (high.astype(np.uint8), 16 * scale)], -minimum.reshape(rows, -1)


_DECODERS: dict[str, Any] = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k}
