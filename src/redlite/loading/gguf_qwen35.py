"""GGUF ``qwen35`` / ``qwen35moe`` (the Qwen3.5 dense and mixture-of-experts hybrids) -> the
Hugging Face names, values and ``config.json`` keys that
:class:`redlite.models.qwen3_5.Qwen3_5Model` loads.

llama.cpp's converter changes these models' tensors on the way to GGUF; :func:`hf_values`
undoes each change:

* every RMSNorm weight except the linear attention's gated norm (``ssm_norm``) is stored as
  ``1 + w`` (llama.cpp applies a plain RMSNorm): ``w = stored - 1``;
* ``ssm_a`` holds ``-exp(A_log)``: ``A_log = log(-ssm_a)``; ``ssm_dt.bias`` is ``dt_bias``;
  ``ssm_conv1d`` is the conv weight squeezed to [C, K] (restored to [C, 1, K]);
* with fewer key heads than value heads, the value heads are reordered from grouped by key
  head (``k0v0, k0v1, .., k1v0, ..``) to tiled (``k0v0, k1v0, .., k0v1, ..``) in the V rows
  of ``attn_qkv``, the rows of ``attn_gate`` (z), ``ssm_beta``, ``ssm_alpha``, in ``ssm_a``,
  ``ssm_dt``, the V channels of ``ssm_conv1d`` and the columns of ``ssm_out``: put back;
* routed experts are stacked per layer: ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H] (or
  one ``ffn_gate_up_exps`` [E, 2I, H]) and ``ffn_down_exps`` [E, H, I]; the shared expert's
  gate ``ffn_gate_inp_shexp`` may be one-dimensional [H] (made [1, H]).

Tensor names follow the ``gguf`` package's tables (``gguf.constants.TENSOR_NAMES``, the
``MODEL_TENSORS`` of ``MODEL_ARCH.QWEN35`` / ``QWEN35MOE``); the tests check
:data:`BLOCK_TENSORS` against them. Used by :mod:`redlite.loading.gguf_weights` and
:mod:`redlite.loading.gguf_config`.
"""

from __future__ import annotations

import re
from typing import Any, Callable

#: GGUF ``general.architecture`` -> (transformers ``model_type``, ``architectures`` entry).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}

#: GGUF block tensor (``blk.N.<part>``) -> Hugging Face name under ``model.layers.N.``
#: (before the ``.weight`` suffix, which :func:`hf_name` drops where HF has none).
BLOCK_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
# HF keeps these as bare parameters (no .weight / .bias suffix)
_BARE = {"ssm_a", "ssm_dt", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"}
_NORMS_PLUS_ONE = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?")


def hf_name(gguf_name: str) -> str:
    """Hugging Face name of a ``qwen35``/``qwen35moe`` GGUF tensor (``blk.0.ssm_a`` ->
    ``model.layers.0.linear_attn.A_log``). Raises ``ValueError`` for an unknown tensor."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if not match or match.group(2) not in BLOCK_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known Qwen3.5 counterpart")
    layer, part, kind = match.groups()
    suffix = "" if part in _BARE else f".{kind or 'weight'}"
    return f"model.layers.{layer}.{BLOCK_TENSORS[part]}{suffix}"


def _untile(a: Any, axis: int, key_heads: int, per_key: int, dim: int) -> Any:
    """Value heads along ``axis`` from tiled back to grouped-by-key-head order."""
    import numpy as np

    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(per_key, key_heads, dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def hf_values(gguf_name: str, data: Any, config: dict[str, Any]) -> Any:
    """The Hugging Face value of GGUF tensor ``gguf_name`` (float32 array ``data`` in HF
    axis order) for a model of ``config`` (the converted ``config.json``): every change
    listed in the module docstring undone. Returns a C-contiguous float32 array."""
    import numpy as np

    part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
    if part in _NORMS_PLUS_ONE or part == "output_norm":
        data = data - 1.0
    elif part == "ssm_a":
        data = np.log(-data)
    elif part == "ffn_gate_inp_shexp":
        data = data.reshape(1, -1)
    hk, hv = config.get("linear_num_key_heads", 0), config.get("linear_num_value_heads", 0)
    if hk and hv and hk != hv and part.startswith(("attn_qkv", "attn_gate", "ssm_")):
        dk, dv, per = config["linear_key_head_dim"], config["linear_value_head_dim"], hv // hk
        if part == "attn_qkv":
            qk = 2 * hk * dk
            data = np.concatenate([data[:qk], _untile(data[qk:], 0, hk, per, dv)])
        elif part == "attn_gate":
            data = _untile(data, 0, hk, per, dv)
        elif part in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
            data = _untile(data, 0, hk, per, 1)
        elif part == "ssm_conv1d":
            qk = 2 * hk * dk
            data = np.concatenate([data[:qk], _untile(data[qk:], 0, hk, per, dv)])
        elif part == "ssm_out":
            data = _untile(data, 1, hk, per, dv)
    if part == "ssm_conv1d" and data.ndim == 2:
        data = data[:, None, :]
    return np.ascontiguousarray(data, dtype=np.float32)


def config_keys(arch: str, optional: Callable[[str, Any], Any], head_dim: int) -> dict[str, Any]:
    """``config.json`` keys of the Qwen3.5 hybrids from ``{arch}.*`` metadata (read with
    ``optional(key, default)``; ``{arch}`` in the key is filled in by it): the Gated
    DeltaNet sizes from ``ssm.*`` (``conv_kernel``, ``state_size`` = key head dim,
    ``group_count`` = key heads, ``time_step_rank`` = value heads, ``inner_size`` = value
    heads x value head dim), ``full_attention_interval`` (default 4), the partial rotary
    factor (``rope.dimension_count`` / ``head_dim``), and for ``qwen35moe`` the expert
    counts and widths (``expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``,
    ``expert_weights_norm``, default True). Raises ``ValueError`` when an ``ssm.*`` key or
    an expert key is missing."""
    def need(key: str) -> Any:
        value = optional(key, None)
        if value is None:
            raise ValueError(f"GGUF file lacks the required key {key.format(arch=arch)!r}")
        return value

    value_heads = int(need("{arch}.ssm.time_step_rank"))
    rotary = optional("{arch}.rope.dimension_count", None)
    factor = int(rotary) / head_dim if rotary else 0.25
    keys: dict[str, Any] = {
        "linear_conv_kernel_dim": int(need("{arch}.ssm.conv_kernel")),
        "linear_key_head_dim": int(need("{arch}.ssm.state_size")),
        "linear_num_key_heads": int(need("{arch}.ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(need("{arch}.ssm.inner_size")) // value_heads,
        "full_attention_interval": int(optional("{arch}.full_attention_interval", 4)),
        "partial_rotary_factor": factor,
    }
    if arch == "qwen35moe":
        keys.update({
            "num_experts": int(need("{arch}.expert_count")),
            "num_experts_per_tok": int(need("{arch}.expert_used_count")),
            "moe_intermediate_size": int(need("{arch}.expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(need("{arch}.expert_shared_feed_forward_length")),
            "norm_topk_prob": bool(optional("{arch}.expert_weights_norm", True)),
        })
    return keys
