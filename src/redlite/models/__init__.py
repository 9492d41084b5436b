"""Model implementations and the registry that picks one for a ``config.json``.

``REGISTRY`` maps an architecture name (an entry of config ``architectures``) or a
``model_type`` to ``"module:ClassName"``; modules are imported only when used, so a model
with extra dependencies costs nothing to the others. Add a line to register a model.
"""

from __future__ import annotations

import importlib
from typing import Any

REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "redlite.models.llama:LlamaModel",
    "MistralForCausalLM": "redlite.models.llama:LlamaModel",
    "Qwen2ForCausalLM": "redlite.models.llama:LlamaModel",
    "Qwen3ForCausalLM": "redlite.models.llama:LlamaModel",
    "llama": "redlite.models.llama:LlamaModel",
    "mistral": "redlite.models.llama:LlamaModel",
    "qwen2": "redlite.models.llama:LlamaModel",
    "qwen3": "redlite.models.llama:LlamaModel",
    "Qwen3_5ForCausalLM": "redlite.models.qwen3_5:Qwen3_5Model",
    "Qwen3_5ForConditionalGeneration": "redlite.models.qwen3_5:Qwen3_5Model",
    "qwen3_5": "redlite.models.qwen3_5:Qwen3_5Model",
    "qwen3_5_text": "redlite.models.qwen3_5:Qwen3_5Model",
    "Qwen3_5MoeForCausalLM": "redlite.models.qwen3_5:Qwen3_5Model",
    "Qwen3_5MoeForConditionalGeneration": "redlite.models.qwen3_5:Qwen3_5Model",
    "qwen3_5_moe": "redlite.models.qwen3_5:Qwen3_5Model",
    "qwen3_5_moe_text": "redlite.models.qwen3_5:Qwen3_5Model",
}


def resolve_model_class(config: dict[str, Any]) -> type:
    """The :class:`~redlite.models.base.CausalLM` subclass for a ``config.json`` dict.

    Tries each name in ``config["architectures"]``, then ``config["model_type"]``.
    Raises ``ValueError`` when none is registered.
    """
    names = list(config.get("architectures") or []) + [config.get("model_type")]
    for name in names:
        target = REGISTRY.get(name) if name else None
        if target:
            module_name, _, class_name = target.partition(":")
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(f"unsupported model: architectures={config.get('architectures')}, "
                     f"model_type={config.get('model_type')!r}")
