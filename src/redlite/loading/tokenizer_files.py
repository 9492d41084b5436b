"""A tokenizer directory read with ``tokenizers`` alone, where that gives what transformers'
``PreTrainedTokenizerFast.from_pretrained`` would (which costs ~1 s of import and ~50 MB more).

:func:`read_plain` takes a directory whose ``tokenizer.json`` is the whole tokenizer: a
``tokenizer_class`` of ``PreTrainedTokenizerFast``/``TokenizersBackend`` (or none; what a
converted GGUF writes), every special token named in ``tokenizer_config.json`` already in the
vocabulary (under its id), no legacy ``special_tokens_map.json`` and one chat template source.
Anything else (a model-specific tokenizer class may change the pipeline) returns None, and the
caller loads through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The named special tokens transformers passes to a chat template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_PLAIN_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


def read_plain(directory: Path) -> tuple[Any, dict[str, str], Any, dict] | None:
    """``(tokenizers.Tokenizer, special tokens {name: text}, chat template source or None,
    tokenizer_config dict)`` of ``directory``, or None when it needs transformers (see the
    module docstring). Never raises for a file it cannot read: None."""
    if not (directory / "tokenizer.json").is_file() or (directory / "special_tokens_map.json").exists():
        return None
    try:
        path = directory / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if not isinstance(config, dict) or config.get("tokenizer_class") not in _PLAIN_CLASSES:
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - unreadable here: transformers decides (and says why)
        return None
    specials = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _content(config.get(name))
        if config.get(name) is not None and (text is None or backend.token_to_id(text) is None):
            return None
        if text is not None:
            specials[name] = text
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if not isinstance(extra, list) or any(backend.token_to_id(_content(t) or "") is None for t in extra):
        return None
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if backend.token_to_id(_content(token) or "") != int(token_id):
            return None
    template = _template(directory, config)
    if template is False:
        return None
    return backend, specials, template, config


def _content(token: Any) -> str | None:
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _template(directory: Path, config: dict) -> Any:
    """The chat template source (str or {name: str}), None when there is none, False when
    more than one place holds one or its form is unknown."""
    sources = []
    inline = config.get("chat_template")
    if isinstance(inline, str):
        sources.append(inline)
    elif isinstance(inline, list) and all(isinstance(t, dict) and {"name", "template"} <= set(t) for t in inline):
        sources.append({t["name"]: t["template"] for t in inline})
    elif inline is not None:
        return False
    if (directory / "chat_template.jinja").is_file():
        sources.append((directory / "chat_template.jinja").read_text(encoding="utf-8"))
    if (directory / "chat_template.json").exists() or (directory / "additional_chat_templates").exists():
        return False
    if len(sources) > 1:
        return False
    return sources[0] if sources else None
