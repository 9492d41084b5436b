"""4-bit weights in the layout of torch's CPU int4 kernel, and their two products.

A weight ``W`` ``[N, K]`` is held as one or more 4-bit parts plus one offset per group of 32
columns: ``W = sum_p codes_p * scale_p + offset`` (see :mod:`redlite.loading.gguf_quant`,
which produces the parts from GGUF blocks exactly). Per part it keeps:

* ``packed``: uint8 ``[N, K // 2]``, the layout of ``torch.ops.aten._convert_weight_to_int4pack_for_cpu``
  for ``N % 64 == 0``: ``[N // 64, K, 32]`` bytes, byte ``j`` of column ``k`` holding row
  ``j`` (low nibble) and row ``j + 32`` (high nibble) of each 64-row block. :func:`pack`
  writes it without the int32 copy torch's converter needs; :func:`layout_matches_torch`
  checks it against torch's converter (the weight object does so once before use);
* ``scale_zero``: bfloat16 ``[K // 32, N, 2]`` for ``torch.ops.aten._weight_int4pack_mm_for_cpu``,
  whose dequantization is ``(code - 8) * scale + zero``: ``scale = scale_p`` and
  ``zero = 8 * scale_p`` (plus ``offset`` for part 0);
* ``scale`` ``[N, K // 32]`` (and one ``offset``) for :meth:`Int4Weight.dequantize`, in float16
  where that holds them exactly (the fp16 fields of Q4_0/Q4_1/Q8_0), else float32.

Two products (:meth:`Int4Weight.linear` picks by row count):

* few rows (decode): the int4 kernel, activations and scales in bfloat16 (its fast path on
  AVX-512; the float32 and float16 paths are reference loops). The result differs from the
  float32-dequantized product by the bfloat16 rounding of the activations and of the
  scales/zeros (relative 2**-9 each), the same order as llama.cpp's 8-bit activation
  quantization in its own CPU dot products;
* many rows (prefill): dequantize to float32 (exactly the GGUF values, see
  :mod:`~redlite.loading.gguf_quant`) and use the dense float32 kernel, which is several
  times faster than the int4 kernel at hundreds of rows on CPUs without AMX.
"""

from __future__ import annotations

import functools

import torch

GROUP = 32
#: Largest row count that goes through the int4 kernel; more rows are dequantized first.
KERNEL_MAX_ROWS = 8


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` (values 0..15, ``N % 64 == 0``) -> uint8 ``[N, K // 2]`` in the
    CPU int4 kernel's layout (module docstring)."""
    n, k = codes.shape
    blocks = codes.reshape(n // 64, 64, k).transpose(1, 2)  # [N/64, K, 64]
    return (blocks[..., :32] | (blocks[..., 32:] << 4)).contiguous().reshape(n, k // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[N, K // 2]`` -> codes uint8 ``[N, K]``."""
    n, half = packed.shape
    k = half * 2
    p = packed.reshape(n // 64, k, 32)
    return torch.cat([p & 15, p >> 4], dim=-1).transpose(1, 2).reshape(n, k)


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Codes ``[len(rows), K]`` of the rows ``rows`` (LongTensor) of a packed weight."""
    n, half = packed.shape
    p = packed.reshape(n // 64, half * 2, 32)
    picked = p[rows // 64, :, rows % 32]  # [R, K]
    return (picked >> (4 * (rows // 32 % 2))[:, None].to(torch.uint8)) & 15


@functools.lru_cache(maxsize=None)
def layout_matches_torch() -> bool:
    """Whether :func:`pack` equals torch's ``_convert_weight_to_int4pack_for_cpu`` (one
    64 x 64 probe) and the kernel exists: the precondition for using the int4 kernel."""
    try:
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (128, 64), generator=gen, dtype=torch.int32)
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return bool(torch.equal(theirs, pack(codes.to(torch.uint8))))
    except (AttributeError, RuntimeError):
        return False


def _compact(values: torch.Tensor) -> torch.Tensor:
    """float32 ``values`` as float16 when that is exact (Q4_0/Q4_1/Q8_0 scales are fp16 in
    the file), else as they are; readers call ``.float()``."""
    values = values.float()
    half = values.half()
    return half if torch.equal(half.float(), values) else values


def supported(n: int, k: int) -> bool:
    """Whether an ``[n, k]`` weight can use the int4 kernel on this torch."""
    return n % 64 == 0 and k % GROUP == 0 and layout_matches_torch()


class Int4Weight:
    """A ``[N, K]`` weight as 4-bit parts (module docstring). Build with :meth:`from_parts`."""

    def __init__(self, packed: list[torch.Tensor], scale: list[torch.Tensor], offset: torch.Tensor,
                 scale_zero: list[torch.Tensor] | None = None):
        self.n, self.k = packed[0].shape[0], packed[0].shape[1] * 2
        self.packed = packed
        self.scale = [_compact(s) for s in scale]  # [N, K/32] per part
        self.offset = _compact(offset)  # [N, K/32]
        if scale_zero is None:  # else as made here before (a saved weight)
            scale_zero = []
            for i, s in enumerate(scale):
                zero = 8 * s + (offset if i == 0 else 0)
                scale_zero.append(torch.stack([s, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous())
        self.scale_zero = scale_zero

    @classmethod
    def from_parts(cls, blocks: list[tuple[list, "object"]]) -> "Int4Weight":
        """Stack row blocks (e.g. q, k and v) into one weight. ``blocks``: per block
        ``(parts, offset)`` as from ``QuantizedTensor.int4_parts`` (numpy arrays); blocks with
        fewer parts get zero parts (codes 0, scale 0)."""
        n_parts = max(len(parts) for parts, _ in blocks)
        packed, scales = [], []
        for p in range(n_parts):
            codes, scale = [], []
            for parts, offset in blocks:
                if p < len(parts):
                    c, s = parts[p]
                    codes.append(torch.from_numpy(c))
                    scale.append(torch.from_numpy(s))
                else:
                    codes.append(torch.zeros(offset.shape[0], offset.shape[1] * GROUP, dtype=torch.uint8))
                    scale.append(torch.zeros(offset.shape, dtype=torch.float32))
            packed.append(pack(torch.cat(codes)))
            scales.append(torch.cat(scale).float().contiguous())
        offset = torch.cat([torch.from_numpy(o) for _, o in blocks]).float().contiguous()
        return cls(packed, scales, offset)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by a stable name (for ``state_dict`` and memory accounting)."""
        out = {"offset": self.offset}
        for i, (p, s, sz) in enumerate(zip(self.packed, self.scale, self.scale_zero)):
            out.update({f"packed{i}": p, f"scale{i}": s, f"scale_zero{i}": sz})
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in float32 (exactly the GGUF values), cast to ``dtype``."""
        w = self.offset.float().repeat_interleave(GROUP, dim=1)
        for packed, scale in zip(self.packed, self.scale):
            codes = unpack(packed).view(self.n, self.k // GROUP, GROUP)
            w.view(self.n, self.k // GROUP, GROUP).addcmul_(codes.float(), scale.float()[..., None])
        return w.to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (LongTensor ``[R]``) dequantized: ``[R, K]`` (embedding lookup)."""
        w = self.offset[index].float().repeat_interleave(GROUP, dim=1)
        for packed, scale in zip(self.packed, self.scale):
            codes = unpack_rows(packed, index).view(len(index), self.k // GROUP, GROUP)
            w.view(len(index), self.k // GROUP, GROUP).addcmul_(codes.float(), scale[index].float()[..., None])
        return w.to(dtype)

    def linear(self, x: torch.Tensor, dense_linear) -> torch.Tensor:
        """``x @ W.T``: ``x`` [T, K] float -> [T, N] in ``x``'s dtype. Up to
        :data:`KERNEL_MAX_ROWS` rows through the int4 kernel, more through
        ``dense_linear(x, W_dequantized, None)``."""
        if x.shape[0] > KERNEL_MAX_ROWS:
            return dense_linear(x, self.dequantize(x.dtype), None)
        xb = x.to(torch.bfloat16)
        out = None
        for packed, scale_zero in zip(self.packed, self.scale_zero):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scale_zero)
            out = y.float() if out is None else out.add_(y)
        return out.to(x.dtype)
