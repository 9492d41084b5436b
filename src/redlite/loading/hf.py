"""Load a Hugging Face model directory (``config.json`` + ``*.safetensors``, sharded too, or a
converted GGUF directory whose ``model.gguf`` links the weights)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

log = logging.getLogger("redlite.loading")


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` dict of a model directory. Raises ``FileNotFoundError``."""
    with open(Path(path) / "config.json", encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a model directory: those named by
    ``model.safetensors.index.json`` when present, else every ``*.safetensors`` (sorted).
    Raises ``FileNotFoundError`` when there are none."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


class LazyTensors(Mapping):
    """Read-only ``name -> torch.Tensor`` view of safetensors files; each tensor is read
    (on CPU, in its stored dtype) when looked up, so peak memory stays near one tensor."""

    def __init__(self, files: list[Path]):
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def default_device() -> torch.device:
    """``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_hf_model(path: str | Path, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None, keep_quantized: bool = True, kernels=None):
    """Build and load the model of a Hugging Face directory: safetensors weights, or the GGUF
    file linked as ``model.gguf`` (a converted GGUF, see :mod:`redlite.loading.gguf`), whose
    quantized tensors stay quantized in the file's memory mapping where a CPU kernel takes
    them (the start-up log says which formats are kept and which were dequantized).

    Returns ``(model, config)``: a :class:`~redlite.models.base.CausalLM` in eval mode on
    ``device`` (default :func:`default_device`) holding weights in ``dtype`` (default
    :func:`default_dtype`; quantized weights compute in float32), and the ``config.json``
    dict. ``keep_quantized`` False dequantizes every GGUF tensor at load (the float32
    reference). ``kernels``: the engine's :class:`~redlite.engine.kernel_options.KernelOptions`
    (None: defaults), given to the model. A checkpoint without ``lm_head.weight`` is loaded with tied embeddings. Raises
    ``FileNotFoundError``, ``ValueError`` (unsupported architecture) or ``KeyError`` (missing
    weight).
    """
    from redlite.models import resolve_model_class

    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    config = read_config(path)
    from redlite.loading.gguf import TENSOR_TABLE

    gguf_table = Path(path) / TENSOR_TABLE
    if gguf_table.exists():
        from redlite.loading.gguf_tensors import GGUFTensors

        tensors = GGUFTensors(path, config, keep_quantized)
    else:
        tensors = LazyTensors(safetensors_files(path))
    build_config = dict(config)
    if "lm_head.weight" not in tensors:
        build_config["tie_word_embeddings"] = True
    model = resolve_model_class(build_config)(build_config, device=device, dtype=dtype, kernels=kernels)
    with torch.inference_mode():
        model.load_hf_weights(tensors)
    if gguf_table.exists():
        from redlite.kernels import native
        from redlite.layers.quant_weight import KERNEL_FORMATS

        types = tensors.type_counts()
        kept = keep_quantized and device.type == "cpu" and native.library() is not None
        dequantized = {t: n for t, n in types.items()
                       if t not in ("F32", "F16", "BF16") and not (kept and t in KERNEL_FORMATS)}
        log.info("GGUF tensors %s; weights: %s; dequantized at load (no quantized kernel here): %s; "
                 "prefill products: %s", _counts(types), _counts(weight_formats(model)),
                 _counts(dequantized) or "none", _prefill_forms(model))
    return model.eval(), config


def weight_formats(model: torch.nn.Module) -> dict[str, int]:
    """Matrices per form held: ``quantized <formats>`` (kept in GGUF blocks) or ``dense
    <dtype>`` (a float tensor, dequantized at load when it came from a quantized GGUF tensor)."""
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        items = list(module.named_parameters(recurse=False)) + [(n, m) for n, m in module.named_children()
                                                                  if getattr(m, "is_quantized", False)]
        for _name, weight in items:
            if id(weight) in seen or (isinstance(weight, torch.Tensor) and weight.dim() < 2):
                continue
            seen.add(id(weight))
            key = (f"quantized {'+'.join(sorted(set(weight.formats)))}" if getattr(weight, "is_quantized", False)
                   else f"dense {str(weight.dtype).removeprefix('torch.')}")
            counts[key] = counts.get(key, 0) + 1
    return counts


def _prefill_forms(model) -> str:
    """How the quantized weights multiply a prompt's tokens (see redlite.layers.quant_weight)."""
    from collections import Counter

    from redlite.layers.quant_weight import BF16_MIN_TOKENS

    forms = Counter(m.prefill for m in model.modules() if getattr(m, "is_quantized", False))
    names = {"bf16": f"bfloat16 (AMX) from {BF16_MIN_TOKENS} tokens", "q16": "16-bit activations (VNNI)",
             "float32": "float32 dequantized"}
    return ", ".join(f"{n} x {names[f]}" for f, n in sorted(forms.items())) or "none quantized"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))
