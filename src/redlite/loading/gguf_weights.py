"""GGUF tensors -> Hugging Face safetensors weights.

:func:`hf_tensor_name` maps llama.cpp tensor names to Hugging Face ones
(``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``; the Qwen3.5 hybrids'
names and value changes are in :mod:`redlite.loading.gguf_qwen35`);
:func:`unpermute_rotary_rows` puts the Q and K rows of the ``llama`` architecture back from
llama.cpp's rotary layout; :func:`write_weights` dequantizes every tensor to float32 (with
``gguf.quants.dequantize``) and saves ``model.safetensors``, or shards of at most
:data:`MAX_SHARD_BYTES` plus ``model.safetensors.index.json``: what
:func:`redlite.loading.gguf.convert_gguf` does for the Qwen3.5 hybrids (the Llama family's
weights stay quantized in the GGUF, see :mod:`redlite.loading.gguf_tensors`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from redlite.loading import gguf_qwen35
from redlite.loading.gguf_config import read_field, write_json

#: Largest safetensors file written (bytes of float32 data); bigger models are sharded.
MAX_SHARD_BYTES = 4 * 1024**3

# GGUF tensor names (llama.cpp's gguf-py ``TENSOR_NAMES``) -> Hugging Face names of the
# Llama/Qwen2/Qwen3 modelling code.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")
# Tensors whose content goes into config.json instead of the weights.
_CONFIG_TENSORS = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor (``blk.3.ffn_up.weight`` ->
    ``model.layers.3.mlp.up_proj.weight``); None for tensors folded into ``config.json``
    (``rope_freqs.weight``).

    Raises:
        ValueError: a tensor this converter does not know (e.g. a fused ``attn_qkv``).
    """
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _CONFIG_TENSORS:
        return None
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face counterpart")


def unpermute_rotary_rows(weight: Any, n_heads: int) -> Any:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (weight or bias).

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) stores, per head, the
    rows of the Hugging Face "rotate_half" layout (first half, second half) interleaved
    (pairs), i.e. ``w.reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2)``. This is the
    inverse. weight: float32 array of shape ``[n_heads * head_dim, ...]``; n_heads: the
    attention heads for Q, the KV heads for K. Returns a new C-contiguous array, same shape.
    """
    import numpy as np

    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    out = weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    return np.ascontiguousarray(out)


def write_weights(reader: Any, config: dict[str, Any], out: Path,
                  on_tensor: Callable[[], None] | None = None) -> tuple[int, int]:
    """Dequantize, rename and save all tensors; returns (tensor count, bytes written).
    ``on_tensor()`` is called after each tensor is dequantized (progress)."""
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    arch = read_field(reader, "general.architecture")
    qwen35 = arch in gguf_qwen35.ARCHITECTURES
    planned: list[tuple[Any, str, int]] = []  # (reader tensor, hf name, float32 bytes)
    for tensor in reader.tensors:
        name = gguf_qwen35.hf_name(tensor.name) if qwen35 else hf_tensor_name(tensor.name)
        if name is None:
            continue
        planned.append((tensor, name, int(tensor.n_elements) * 4))

    shards: list[list[tuple[Any, str, int]]] = [[]]
    size = 0
    for item in planned:
        if shards[-1] and size + item[2] > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[2]

    def load(tensor: Any) -> Any:
        data = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest-first
        data = np.asarray(data, dtype=np.float32).reshape(shape)
        if arch == "llama" and re.fullmatch(r"blk\.\d+\.attn_(q|k)\.(weight|bias)", tensor.name):
            heads = config["num_attention_heads"] if ".attn_q." in tensor.name else config["num_key_value_heads"]
            data = unpermute_rotary_rows(data, heads)
        if qwen35:
            data = gguf_qwen35.hf_values(tensor.name, data, config)
        data = np.ascontiguousarray(data)
        if on_tensor is not None:
            on_tensor()
        return data

    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards):
        filename = (
            "model.safetensors" if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        arrays = {name: load(tensor) for tensor, name, _ in shard}
        save_file(arrays, str(out / filename), metadata={"format": "pt"})
        for name, array in arrays.items():
            weight_map[name] = filename
            total += array.nbytes
        del arrays
    if len(shards) > 1:
        write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )
    return len(weight_map), total
