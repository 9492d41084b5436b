"""Weights kept in GGUF block formats: :class:`QuantTensor` (one tensor's raw blocks, as read
from the file) and :class:`QuantWeight` (a ``[out, in]`` matrix stacked from such row blocks,
owning its kernels).

``QuantWeight`` is what a layer holds in place of a dense weight when the weights come from a
GGUF file and run on CPU; :func:`redlite.layers.linear.linear_kernel`'s functions and
:func:`redlite.layers.linear.embedding` accept either, so model code never asks which.

* few tokens (decode, ``T <= SMALL_BATCH``): our C kernels (:mod:`redlite.kernels.native`),
  on the activations :data:`DECODE_ACTIVATIONS` unless asked otherwise:
  ``"q16"`` rounds each activation row to 16 bits per 32 values (scale ``max|x| / 32767``)
  and sums codes times activations in integers (``qmatvec_q16x``; mins and offsets use the
  float32 block sums of x): off by at most :func:`activation_rounding_bound` (``levels``
  32767), about 2x faster than float32 where compute-bound, and the greedy text of the
  regression prompts equals the float32 reference's (tests/test_quant_model.py).
  ``"float32"`` (``qmatvec``): per block, the codes times the float32 activations, then the
  block's scale (and its min times the block's activation sum): the float32 product of the
  dequantized weight up to the order of the additions (see :func:`float32_error_bound`).
  ``"q8"`` rounds to 8 bits per 32 values (``max|x| / 127``, as llama.cpp does;
  ``qmatmul_q8x``): fastest, but off by up to ``levels`` 127, which changes greedy text.
* more tokens (prefill), in the form :data:`PREFILL_ACTIVATIONS` unless asked otherwise:
  ``"bf16"`` (where the CPU has AMX bf16, from :data:`BF16_MIN_TOKENS` tokens; fewer take
  ``"q16"`` where it can, else ``"float32"``): the weight is dequantized straight to bfloat16
  for the call (``dequant_parts_bf16``: the float32 values rounded to nearest even) and
  multiplied with the activations rounded to bfloat16 by torch's AMX kernel, summed in
  float32: each weight and activation off by up to 2**-9 of itself, the rounding of
  PyTorch's own bfloat16 products; faster than ``"q16"`` on long prompts
  (``bench/results/cpu-*-bf16-prefill.md``).
  ``"q16"`` (where the CPU has AVX512-VNNI and every part is in :data:`GEMM_FORMATS`; other
  weights take ``"float32"``): the activations rounded as for ``"q16"`` decode and the codes
  times them summed exactly in int32 (``qgemm_q16x``, codes decoded once per call for all
  tokens): decode's arithmetic, and faster than the float32 product (``bench/cpu.py``).
  ``"float32"``: the weight is dequantized to float32 (C, multi-threaded) for the call and
  multiplied by the dense kernel: the float32 reference's result.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from redlite.kernels import native

#: GGML type ids of the formats our kernels take.
KERNEL_FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
#: Most activation rows for the integer kernel; more go through a float32 dequantization.
SMALL_BATCH = 4
#: The activations of few-token products (see the module docstring).
DECODE_ACTIVATIONS = "q16"
#: Rounding levels of each activation form (0: not rounded).
ACTIVATION_LEVELS = {"float32": 0, "q8": 127, "q16": 32767}
#: Forms of many-token products (see the module docstring).
PREFILL_FORMS = ("float32", "q16", "bf16")
#: Formats the many-token q16 kernel takes.
GEMM_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K")
#: Fewest tokens of a ``"bf16"`` product: below, dequantizing the whole weight costs more than
#: the AMX product saves.
BF16_MIN_TOKENS = 128
#: The default form of many-token products: bf16 with AMX, else q16 with AVX512-VNNI.
PREFILL_ACTIVATIONS = "bf16" if native.has_amx_bf16() else "q16" if native.has_vnni512() else "float32"


@dataclass
class QuantTensor:
    """Raw GGUF blocks of a 2-D tensor: ``qtype`` (GGML type name, e.g. ``"Q4_K"``),
    ``shape`` ``(rows, cols)`` of the values, ``data`` uint8 ``[rows, row_bytes]`` (a view of
    the memory-mapped file or a copy)."""

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]`` by ``gguf.quants.dequantize`` (the reference)."""
        import gguf

        values = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.qtype])
        return np.asarray(values, dtype=np.float32).reshape(self.shape)

    def take_rows(self, order: np.ndarray) -> "QuantTensor":
        """A copy with rows in ``order`` (exact: GGUF blocks never span rows)."""
        return QuantTensor(self.qtype, self.shape, np.ascontiguousarray(self.data[order]))


def kernel_supported(blocks: list[Any], device: torch.device) -> bool:
    """True when row blocks ``blocks`` (tensors or :class:`QuantTensor`) can stay quantized:
    all quantized, in :data:`KERNEL_FORMATS`, on CPU, with the kernel library loaded."""
    return (device.type == "cpu" and all(isinstance(b, QuantTensor) and b.qtype in KERNEL_FORMATS for b in blocks)
            and len({b.shape[1] for b in blocks}) == 1 and native.library() is not None)


class QuantWeight(nn.Module):
    """A ``[out, in]`` weight stacked from :class:`QuantTensor` row blocks in kernel formats.

    The blocks' bytes are buffers (``part0``, ``part1``, ...; in ``state_dict``, so the weight
    fingerprint covers them) sharing memory with the given arrays (no copy of a memory-mapped
    file). ``shape``: ``(out, in)``; ``formats``: the parts' type names. ``activations``: of
    few-token products, ``prefill``: of many-token ones (see the module docstring; ``"q16"``
    where this weight cannot take it is ``"float32"``).
    """

    is_quantized = True

    def __init__(self, blocks: list[QuantTensor], activations: str = DECODE_ACTIVATIONS,
                 prefill: str = PREFILL_ACTIVATIONS):
        super().__init__()
        if activations not in ACTIVATION_LEVELS:
            raise ValueError(f"activations must be one of {sorted(ACTIVATION_LEVELS)}, got {activations!r}")
        if prefill not in PREFILL_FORMS:
            raise ValueError(f"prefill must be one of {PREFILL_FORMS}, got {prefill!r}")
        self.activations = activations
        self.lib = native.library()
        if self.lib is None or not blocks:
            raise ValueError("QuantWeight needs the kernel library and at least one block")
        cols = blocks[0].shape[1]
        self.formats = tuple(b.qtype for b in blocks)
        self.shape = (sum(b.shape[0] for b in blocks), cols)
        self.parts = (native.Part * len(blocks))()
        for i, block in enumerate(blocks):
            data = np.ascontiguousarray(block.data)
            tensor = _as_tensor(data)
            self.register_buffer(f"part{i}", tensor, persistent=True)
            self.parts[i] = native.Part(tensor.data_ptr(), int(data.shape[1]), int(data.shape[0]),
                                        KERNEL_FORMATS[block.qtype])
        self.n_parts = len(blocks)
        self.gemm_ok = native.has_vnni512() and all(f in GEMM_FORMATS for f in self.formats)
        self.prefill = prefill if self.gemm_ok or prefill == "bf16" else "float32"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, dense=None,
               rows_alone: bool = False) -> torch.Tensor:
        """``x @ W.T (+ bias)``: ``x`` [T, in] -> new [T, out] in x's dtype (computed in
        float32). ``dense``: the dense linear function for the dequantized path (default
        ``F.linear``). ``rows_alone``: the small-batch kernel whatever T, so each row is
        bitwise what it is alone (the rows of a batched decode step)."""
        if x.dtype != torch.float32:
            bias = None if bias is None else bias.float()
            return self.linear(x.float(), bias, dense, rows_alone).to(x.dtype)
        n_tok = x.shape[0]
        form = self.prefill if n_tok > SMALL_BATCH and not rows_alone else None
        if form == "bf16" and n_tok < BF16_MIN_TOKENS:
            form = "q16" if self.gemm_ok else "float32"
        if form == "bf16":
            out = (dense or torch.nn.functional.linear)(x.to(torch.bfloat16), self.dequantize_bf16()).float()
            return out if bias is None else out.add_(bias)
        if form == "float32":
            return (dense or torch.nn.functional.linear)(x, self.dequantize(), bias)
        x = x.contiguous()
        out = torch.empty(n_tok, self.shape[0], dtype=torch.float32)
        if form == "q16":
            self.lib.qgemm_q16x(self.parts, self.n_parts, x.data_ptr(), n_tok, self.shape[1], out.data_ptr(),
                                self.shape[0])
        elif self.activations == "q8":
            self.lib.qmatmul_q8x(self.parts, self.n_parts, x.data_ptr(), n_tok, self.shape[1], out.data_ptr(),
                                 self.shape[0])
        elif self.activations == "q16":
            self.lib.qmatvec_q16x(self.parts, self.n_parts, x.data_ptr(), n_tok, self.shape[1], out.data_ptr(),
                                  self.shape[0])
        else:
            self.lib.qmatvec(self.parts, self.n_parts, x.data_ptr(), n_tok, self.shape[1], out.data_ptr(),
                             self.shape[0], 0)
        return out if bias is None else out.add_(bias)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as a new float32 tensor ``[out, in]``."""
        out = torch.empty(self.shape, dtype=torch.float32)
        self.lib.dequant_parts(self.parts, self.n_parts, self.shape[1], out.data_ptr())
        return out

    def dequantize_bf16(self) -> torch.Tensor:
        """The whole weight as a new bfloat16 tensor ``[out, in]``: :meth:`dequantize`'s values
        rounded to nearest even, in one pass (no float32 copy)."""
        out = torch.empty(self.shape, dtype=torch.bfloat16)
        self.lib.dequant_parts_bf16(self.parts, self.n_parts, self.shape[1], out.data_ptr())
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (LongTensor [T], < the first part's rows) dequantized: float32 [T, in]
        (an embedding lookup)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.shape[1], dtype=torch.float32)
        self.lib.dequant_rows(ctypes.byref(self.parts[0]), ids.data_ptr(), ids.shape[0], self.shape[1],
                              out.data_ptr())
        return out

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, formats={'+'.join(self.formats)}"


def _as_tensor(data: np.ndarray) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # read-only file mapping: the kernels never write to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def dequantize_block(block: Any) -> torch.Tensor:
    """A row block as a dense float32 tensor: tensors as they are, :class:`QuantTensor` through
    the C kernels when loaded (same values as ``gguf``'s), else ``gguf.quants.dequantize``."""
    if not isinstance(block, QuantTensor):
        return block
    if block.qtype in KERNEL_FORMATS and native.library() is not None:
        return QuantWeight([block]).dequantize()
    return torch.from_numpy(block.dequantize())


def float32_error_bound(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Bound on ``|kernel(x) - weight @ x|`` (exact arithmetic) for float32 activations: the
    classic bound of a float32 dot product summed in any order, ``gamma_(n+2) * sum_j |W_ij x_j|``
    with ``gamma_k = k u / (1 - k u)``, ``u = 2**-24`` (the two extra roundings: the block
    scale and the min term). ``weight`` [out, in], ``x`` [in]; float64 [out]."""
    k = (x.shape[-1] + 2) * 2.0**-24
    return (weight.double().abs() @ x.double().abs()) * (k / (1 - k))


def activation_rounding_bound(weight: torch.Tensor, x: torch.Tensor, levels: int) -> torch.Tensor:
    """Bound on ``|kernel(x) - weight @ x|`` from rounding the activations to ``levels`` steps
    per sign (127: q8, 32767: q16) alone: per output,
    ``sum_blocks (max|x_block| / levels / 2) * sum_{j in block} |W_ij|`` (float64,
    ``weight`` [out, in], ``x`` [in]). Float32 rounding of the sums comes on top."""
    half_step = x.double().reshape(-1, 32).abs().amax(dim=1) / levels / 2
    return (weight.double().abs().reshape(weight.shape[0], -1, 32).sum(dim=2) * half_step).sum(dim=1)
