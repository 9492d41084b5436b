"""Qwen3.5 ``config.json`` handling: the text-model settings with defaults filled in.

:func:`text_config` accepts both layouts (text-only ``qwen3_5_text``, multimodal ``qwen3_5``
with a nested ``text_config``) and returns the flat text settings
:class:`~redlite.models.qwen3_5.Qwen3_5Model` builds from, including the per-layer pattern
of :data:`LINEAR` (Gated DeltaNet) and :data:`FULL` (gated full attention) layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FULL", "LINEAR", "text_config"]

#: ``layer_types`` entry of a Gated DeltaNet (linear-attention) layer.
LINEAR = "linear_attention"
#: ``layer_types`` entry of a gated full-attention layer.
FULL = "full_attention"


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text-model part of a Qwen3.5 ``config.json`` dict, with defaults filled in.

    Accepts the text-only config (``model_type`` ``qwen3_5_text``) and the multimodal one
    (``qwen3_5``, text settings nested under ``text_config``). Fills ``layer_types`` from
    ``full_attention_interval`` (default 4), and resolves ``rope_theta`` /
    ``partial_rotary_factor`` from ``rope_parameters`` (transformers 5), ``rope_scaling`` or
    the top level (older files); defaults 10000 and 0.25 as in ``Qwen3_5TextConfig``.
    ``tie_word_embeddings`` is taken from the top level when present there (that is what
    transformers ties on), else from the text config.

    ``rope_parameters`` in the result is normalised for
    :meth:`~redlite.layers.rotary.RotaryTable.from_config` (an ``mrope`` type becomes
    ``default``: with text-only positions the three M-RoPE sections coincide).

    Raises ValueError for a ``layer_types`` entry other than ``linear_attention`` /
    ``full_attention`` or a ``hidden_act`` other than silu (an unsupported rope type raises
    when the model is built).
    """
    cfg = dict(config.get("text_config") or config)
    n_layers = int(cfg.get("num_hidden_layers", 32))
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
    layer_types = list(layer_types)[:n_layers]
    if len(layer_types) != n_layers or any(t not in (LINEAR, FULL) for t in layer_types):
        raise ValueError(f"bad layer_types for {n_layers} layers: {layer_types}")
    cfg["layer_types"] = layer_types

    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (Qwen3.5 uses silu)")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    rope["rope_type"] = "default" if rope_type == "mrope" else rope_type  # text: M-RoPE == 1-D
    rope["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope["partial_rotary_factor"] = float(rope.get("partial_rotary_factor",
                                                   cfg.get("partial_rotary_factor", 0.25)))
    cfg["rope_parameters"] = rope
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if "tie_word_embeddings" in config:
        cfg["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
    cfg.setdefault("tie_word_embeddings", False)
    return cfg
