"""GGUF metadata -> Hugging Face ``config.json`` and ``generation_config.json`` contents.

:func:`gguf_to_hf_config` builds the transformers config of a ``llama``, ``qwen2``, ``qwen3``,
``qwen35`` or ``qwen35moe`` GGUF file from its metadata keys (and, for Llama 3 style rope scaling, the
``rope_freqs.weight`` tensor); :func:`generation_config` the bos/eos/pad ids. The rope scaling
helpers turn ``{arch}.rope.scaling.*`` keys or stored Llama 3 divisors back into a
transformers ``rope_scaling``. :func:`read_field`, :func:`int_or_none` and :func:`write_json`
are the small metadata/JSON helpers the other ``redlite.loading.gguf*`` modules share.
Used by :func:`redlite.loading.gguf.convert_gguf`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from redlite.loading.gguf_qwen35 import ARCHITECTURES as QWEN35_ARCHITECTURES
from redlite.loading.gguf_qwen35 import config_keys as qwen35_config_keys

logger = logging.getLogger("redlite.loading")

#: GGUF ``general.architecture`` -> (transformers ``model_type``, ``architectures`` entry).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    **QWEN35_ARCHITECTURES,
}

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def gguf_to_hf_config(reader: Any) -> dict[str, Any]:
    """Build a transformers ``config.json`` dict from an open ``gguf.GGUFReader``.

    For the Qwen3.5 hybrids (``qwen35``, ``qwen35moe``) the keys of
    :func:`redlite.loading.gguf_qwen35.config_keys` are added (and ``feed_forward_length``
    is optional for ``qwen35moe``).

    Sources (``{arch}`` = ``general.architecture``):
    ``num_hidden_layers`` <- ``{arch}.block_count``; ``hidden_size`` <-
    ``{arch}.embedding_length``; ``intermediate_size`` <- ``{arch}.feed_forward_length``;
    ``num_attention_heads`` <- ``{arch}.attention.head_count``; ``num_key_value_heads`` <-
    ``{arch}.attention.head_count_kv`` (default: head_count); ``head_dim`` <-
    ``{arch}.attention.key_length``, else ``{arch}.rope.dimension_count`` (llama), else
    hidden_size / heads; ``rope_theta`` <- ``{arch}.rope.freq_base`` (default 10000.0);
    ``rms_norm_eps`` <- ``{arch}.attention.layer_norm_rms_epsilon`` (default 1e-5);
    ``max_position_embeddings`` <- ``{arch}.context_length``; ``rope_scaling`` <-
    ``{arch}.rope.scaling.{type,factor,original_context_length,attn_factor,yarn_beta_fast,
    yarn_beta_slow}`` or, for Llama 3 style scaling, the ``rope_freqs.weight`` tensor;
    ``vocab_size`` <- rows of ``token_embd.weight``; ``tie_word_embeddings`` <- no
    ``output.weight`` tensor; ``attention_bias`` <- an ``attn_q.bias`` tensor exists;
    ``bos_token_id``/``eos_token_id``/``pad_token_id`` <- ``tokenizer.ggml.*_token_id``.
    Rope settings are written both as legacy ``rope_theta``/``rope_scaling`` and as
    transformers 5's ``rope_parameters``.

    Raises:
        ValueError: unsupported architecture, a required key missing, or rope scaling that
            cannot be expressed as a transformers ``rope_scaling``.
    """
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    model_type, hf_class = SUPPORTED_ARCHITECTURES[arch]

    def required(key: str) -> Any:
        value = read_field(reader, key.format(arch=arch))
        if value is None:
            raise ValueError(f"GGUF file lacks the required key {key.format(arch=arch)!r}")
        return value

    def optional(key: str, default: Any = None) -> Any:
        value = read_field(reader, key.format(arch=arch))
        return default if value is None else value

    tensors = {t.name: t for t in reader.tensors}
    n_layers = int(required("{arch}.block_count"))
    hidden = int(required("{arch}.embedding_length"))
    n_heads = int(required("{arch}.attention.head_count"))
    n_kv_heads = int(optional("{arch}.attention.head_count_kv", n_heads))
    head_dim = optional("{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = optional("{arch}.rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads
    rope_theta = float(optional("{arch}.rope.freq_base", 10000.0))

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shape is [hidden, vocab]
    meta_vocab = optional("{arch}.vocab_size")
    if meta_vocab is not None and int(meta_vocab) != vocab_size:
        logger.warning("%s.vocab_size=%s differs from token_embd rows %d; using the latter", arch, meta_vocab, vocab_size)

    rope_scaling = _rope_scaling(reader, arch, rope_theta, head_dim, tensors)
    context_length = optional("{arch}.context_length")
    if context_length is None:
        context_length = 4096
        logger.warning("GGUF file lacks %s.context_length; assuming %d", arch, context_length)

    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(optional("{arch}.feed_forward_length", 0) if arch == "qwen35moe"
                                 else required("{arch}.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(context_length),
        "rms_norm_eps": float(optional("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}
        if rope_scaling is None
        else {**rope_scaling, "rope_theta": rope_theta},
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "attention_dropout": 0.0,
        "bos_token_id": int_or_none(optional("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int_or_none(optional("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int_or_none(optional("tokenizer.ggml.padding_token_id")),
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if arch in QWEN35_ARCHITECTURES:
        config.update(qwen35_config_keys(arch, optional, head_dim))
        config["rope_parameters"]["partial_rotary_factor"] = config["partial_rotary_factor"]
    return config


def generation_config(reader: Any) -> dict[str, Any]:
    """bos/eos/pad ids for ``generation_config.json``: ``eos_token_id`` lists
    ``tokenizer.ggml.eos_token_id``, ``.eot_token_id`` and ``.eom_token_id`` (those present)."""
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = int_or_none(read_field(reader, f"tokenizer.ggml.{key}"))
        if value is not None and value not in eos:
            eos.append(value)
    config: dict[str, Any] = {
        "bos_token_id": int_or_none(read_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    pad = int_or_none(read_field(reader, "tokenizer.ggml.padding_token_id"))
    if pad is not None:
        config["pad_token_id"] = pad
    return config


# --------------------------------------------------------------------------------------------
# Rope scaling
# --------------------------------------------------------------------------------------------


def _rope_scaling(reader: Any, arch: str, rope_theta: float, head_dim: int, tensors: dict[str, Any]) -> dict | None:
    """transformers ``rope_scaling`` from ``{arch}.rope.scaling.*`` keys or ``rope_freqs.weight``."""
    kind = read_field(reader, f"{arch}.rope.scaling.type")
    factor = read_field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and read_field(reader, f"{arch}.rope.scale_linear") is not None:  # older files
        kind, factor = "linear", read_field(reader, f"{arch}.rope.scale_linear")
    scaling: dict[str, Any] | None = None
    if kind in (None, "none"):
        scaling = None
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        extra = {
            "original_context_length": ("original_max_position_embeddings", int),
            "attn_factor": ("attention_factor", float),
            "yarn_beta_fast": ("beta_fast", float),
            "yarn_beta_slow": ("beta_slow", float),
        }
        for gguf_key, (hf_key, cast) in extra.items():
            value = read_field(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = cast(value)
    else:
        raise ValueError(f"rope scaling type {kind!r} ({arch}.rope.scaling.type) is not supported")

    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ValueError("GGUF has both rope_freqs.weight and rope scaling keys; not supported")
        import numpy as np
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        scaling = llama3_rope_scaling_from_factors(freqs, rope_theta, head_dim)
    return scaling


def llama3_rope_factors(
    rope_theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> list[float]:
    """Per-frequency divisors of Llama 3 rope scaling, as llama.cpp's converter stores them in
    ``rope_freqs.weight`` (shape ``[head_dim // 2]``): 1 for wavelengths below
    ``original / high_freq_factor``, ``factor`` above ``original / low_freq_factor``, a smooth
    blend between. Same rule as transformers' ``_compute_llama3_parameters``."""
    low_wavelen = original / low_freq_factor
    high_wavelen = original / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (rope_theta ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def llama3_rope_scaling_from_factors(factors: Any, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """Recover transformers' ``{"rope_type": "llama3", ...}`` from a ``rope_freqs.weight`` tensor.

    The GGUF stores only the resulting divisors; ``factor`` is their maximum and the other
    parameters are searched among the values Llama 3.x releases use (low 1, high 4, original
    context 8192, plus a few neighbours), accepting a match within 1e-4 relative.

    Raises:
        ValueError: no parameter set reproduces the stored divisors.
    """
    import numpy as np

    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"rope_freqs.weight has {factors.shape[0]} values, expected {head_dim // 2}")
    factor = float(factors.max())
    if abs(factor - round(factor)) <= 1e-4 * factor:  # float32 storage blurs e.g. 8 into 8.000001
        factor = float(round(factor))
    for original in (8192, 4096, 16384, 2048, 32768, 131072):
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 8.0, 2.0):
                if high <= low:
                    continue
                expected = np.asarray(llama3_rope_factors(rope_theta, head_dim, factor, low, high, original))
                if np.allclose(expected, factors, rtol=1e-4, atol=0):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": original,
                    }
    raise ValueError("rope_freqs.weight does not match Llama 3 rope scaling; not supported")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def read_field(reader: Any, key: str) -> Any:
    """A GGUF metadata value as a plain Python value (str, int, float, bool, list), or None."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if len(field.types) == 1 and field.types[0].name == "FLOAT32":
        # Shortest decimal that round-trips the stored float32 (1e-05, not 9.99999974e-06).
        import numpy as np

        return float(str(np.float32(value)))
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    return value


def int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
