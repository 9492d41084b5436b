"""GGUF tensor names and layout -> Hugging Face ones.

:func:`hf_tensor_name` maps llama.cpp tensor names to Hugging Face ones
(``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``);
:func:`unpermute_rotary_rows` puts the Q and K rows of the ``llama`` architecture back from
llama.cpp's rotary layout. Used by :mod:`redlite.loading.gguf` and
:mod:`redlite.loading.gguf_tensors`.
"""

from __future__ import annotations

import re
from typing import Any

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
