"""The weights of a GGUF file by Hugging Face name, kept in their file format.

:class:`GGUFTensors` is a read-only mapping ``hf name -> value`` over a memory-mapped GGUF
file (``gguf.GGUFReader``): float tensors (F32, F16, BF16: norms, biases) come as float32
``torch.Tensor``; quantized ones as :class:`~redlite.loading.gguf_quant.QuantizedTensor`
(the raw blocks), which :class:`redlite.layers.linear.Linear` keeps quantized where a kernel
takes them and dequantizes otherwise. Values are built on access, so loading holds one
tensor's temporary at a time. For the ``llama`` architecture the Q and K rows are put back
from llama.cpp's rotary layout, on the raw blocks (a row permutation, exact).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from redlite.loading.gguf_config import read_field
from redlite.loading.gguf_quant import QuantizedTensor
from redlite.loading.gguf_weights import hf_tensor_name, unpermute_rotary_rows

_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


class GGUFTensors(Mapping):
    """``name -> torch.Tensor | QuantizedTensor`` of one GGUF file.

    ``path``: the GGUF file; ``config``: its ``config.json`` dict (for the head counts of the
    llama Q/K row order). Raises ``ValueError`` for a tensor name with no Hugging Face
    counterpart (as :func:`~redlite.loading.gguf_weights.hf_tensor_name`).
    """

    def __init__(self, path: str | Path, config: dict[str, Any]):
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.config = config
        self.arch = read_field(self.reader, "general.architecture")
        self._by_name = {}
        for tensor in self.reader.tensors:
            name = hf_tensor_name(tensor.name)
            if name is not None:
                self._by_name[name] = tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __getitem__(self, name: str) -> torch.Tensor | QuantizedTensor:
        tensor = self._by_name[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest-first
        kind = tensor.tensor_type.name
        heads = self._rotary_heads(tensor.name)
        if kind in _FLOAT_TYPES or kind == "BF16":
            data = np.asarray(tensor.data)
            if kind == "BF16":
                data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            data = data.astype(np.float32).reshape(shape)
            if heads:
                data = unpermute_rotary_rows(data, heads)
            return torch.from_numpy(np.ascontiguousarray(data))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        quant = QuantizedTensor(kind, (rows, shape[-1]), np.asarray(tensor.data).reshape(rows, -1))
        if heads:
            order = unpermute_rotary_rows(np.arange(rows)[:, None], heads)[:, 0]
            quant = quant.rows(order)
        return quant

    def _rotary_heads(self, gguf_name: str) -> int:
        """Heads to un-permute over for a llama Q/K weight or bias, else 0."""
        if self.arch != "llama" or not re.fullmatch(r"blk\.\d+\.attn_(q|k)\.(weight|bias)", gguf_name):
            return 0
        config = self.config
        return int(config["num_attention_heads"] if ".attn_q." in gguf_name else config["num_key_value_heads"])

    def file_types(self) -> dict[str, int]:
        """Count of tensors per GGUF type name (for the start-up log)."""
        counts: dict[str, int] = {}
        for tensor in self._by_name.values():
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return counts
