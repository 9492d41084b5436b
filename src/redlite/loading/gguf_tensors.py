"""The weights of a GGUF file by Hugging Face name, kept in their file format.

:class:`GGUFTensors` is a read-only mapping ``hf name -> value`` over the memory-mapped file,
located by the tensor table a conversion wrote (``gguf_tensors.json``, see
:func:`redlite.loading.gguf.tensor_table`; no GGUF metadata parse at start): float tensors
(F32, F16, BF16: norms, biases) come as float32 ``torch.Tensor``; quantized ones as :class:`~redlite.layers.quant_weight.QuantTensor` holding
the raw blocks as a view of the mapping (no copy), which the model keeps quantized where a
kernel takes them and dequantizes otherwise. For the ``llama`` architecture the Q and K rows
are put back from llama.cpp's rotary layout on the raw blocks (a row permutation: exact;
these few tensors are copied).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from redlite.layers.quant_weight import QuantTensor, dequantize_block
from redlite.loading.gguf_weights import hf_tensor_name, unpermute_rotary_rows

_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_ROTARY_RE = re.compile(r"blk\.\d+\.attn_(q|k)\.(weight|bias)")


class GGUFTensors(Mapping):
    """``name -> torch.Tensor | QuantTensor`` of one converted GGUF directory.

    ``directory``: holds ``model.gguf`` (the file) and ``gguf_tensors.json`` (its table);
    ``config``: its ``config.json`` dict (for the head counts of the llama Q/K row order);
    ``keep_quantized`` False: quantized tensors come dequantized (float32 tensors). Raises
    ``FileNotFoundError`` when either is missing, ``ValueError`` for a tensor name with no
    Hugging Face counterpart or a table that does not fit the file.
    """

    def __init__(self, directory: str | Path, config: dict[str, Any], keep_quantized: bool = True):
        from redlite.loading.gguf import GGUF_LINK, TENSOR_TABLE

        directory = Path(directory)
        table = json.loads((directory / TENSOR_TABLE).read_text(encoding="utf-8"))
        self.path = directory / GGUF_LINK
        self.file = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.config = config
        self.keep_quantized = keep_quantized
        self.arch = table["architecture"]
        self._by_name = {}
        for entry in table["tensors"]:
            name = hf_tensor_name(entry["name"])
            if entry["offset"] + entry["nbytes"] > self.file.shape[0]:
                raise ValueError(f"{self.path}: tensor {entry['name']} lies past the end of the file")
            if name is not None:
                self._by_name[name] = entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __getitem__(self, name: str) -> torch.Tensor | QuantTensor:
        entry = self._by_name[name]
        shape = tuple(reversed(entry["shape"]))  # GGUF lists dims fastest-first
        kind = entry["type"]
        raw = self.file[entry["offset"]:entry["offset"] + entry["nbytes"]]
        heads = self._rotary_heads(entry["name"])
        if kind in _FLOATS:
            data = raw.view(_FLOATS[kind])
            if kind == "BF16":
                data = (data.astype(np.uint32) << 16).view(np.float32)
            data = data.astype(np.float32).reshape(shape)
            if heads:
                data = unpermute_rotary_rows(data, heads)
            return torch.from_numpy(np.ascontiguousarray(data))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        quant = QuantTensor(kind, (rows, shape[-1]), raw.reshape(rows, -1))
        if heads:
            quant = quant.take_rows(unpermute_rotary_rows(np.arange(rows)[:, None], heads)[:, 0])
        return quant if self.keep_quantized else dequantize_block(quant)

    def _rotary_heads(self, gguf_name: str) -> int:
        """Heads to un-permute over for a llama Q/K weight or bias, else 0."""
        if self.arch != "llama" or not _ROTARY_RE.fullmatch(gguf_name):
            return 0
        key = "num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"
        return int(self.config[key])

    def type_counts(self) -> dict[str, int]:
        """Tensors per GGUF type name (for the start-up log)."""
        counts: dict[str, int] = {}
        for entry in self._by_name.values():
            counts[entry["type"]] = counts.get(entry["type"], 0) + 1
        return counts
