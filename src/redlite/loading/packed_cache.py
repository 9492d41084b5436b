"""A loaded model's weights saved as they are held, so later starts skip the GGUF repacking.

Reading a GGUF file (its metadata, tokenizer arrays included, is parsed in Python) and
repacking its blocks into the int4 kernel's layout takes seconds; the packed weights are the
same size as the GGUF (4-bit codes plus per-32 scales), so they are kept next to the
converted model directory: :func:`save` writes every parameter and buffer of the model
(``safetensors``, shared tensors once, each :class:`~redlite.layers.linear.Linear`'s format in
the metadata) and :func:`load` restores them into a freshly built model of the same config.
Layers without a quantized kernel are saved as held, i.e. dequantized in the model dtype.
The file name carries device and dtype (``weights-cpu-float32.safetensors``); it is written to
a temporary name and renamed, so a killed save leaves no partial file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from redlite.layers.linear import Linear


def cache_path(directory: str | Path, device: torch.device, dtype: torch.dtype) -> Path:
    """Where the packed weights of ``directory``'s model live for ``device``/``dtype``."""
    return Path(directory) / f"weights-{device.type}-{str(dtype).removeprefix('torch.')}.safetensors"


def _owned(model: nn.Module):
    """(module name, module, {local name: tensor}) for each distinct module's own tensors."""
    for prefix, module in model.named_modules():
        own = {n: t for n, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
               if t is not None}
        yield prefix, module, own


def save(model: nn.Module, path: Path) -> None:
    """Write ``model``'s tensors to ``path`` (see the module docstring)."""
    from safetensors.torch import save_file

    tensors, formats = {}, {}
    for prefix, module, own in _owned(model):
        for name, tensor in own.items():
            tensors[f"{prefix}.{name}" if prefix else name] = tensor.detach().contiguous()
        if isinstance(module, Linear):
            formats[prefix] = module.format
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"formats": json.dumps(formats)})
    tmp.chmod(0o644)
    os.replace(tmp, path)


def load(model: nn.Module, path: Path) -> None:
    """Restore tensors written by :func:`save` into ``model`` (built from the same config,
    uninitialised). Raises ``KeyError`` when the file lacks a tensor the model has."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        formats = json.loads(f.metadata()["formats"])
        keys = set(f.keys())
        for prefix, module, own in _owned(model):
            def key(name: str) -> str:
                return f"{prefix}.{name}" if prefix else name

            if isinstance(module, Linear):
                mine = {k[len(prefix) + 1:]: f.get_tensor(k) for k in keys if k.startswith(prefix + ".")
                        and "." not in k[len(prefix) + 1:]}
                module.load_state(mine, formats[prefix])
                continue
            for name, tensor in own.items():
                tensor.copy_(f.get_tensor(key(name)))
