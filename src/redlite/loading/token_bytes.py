"""The bytes each token id spells, from a ``tokenizers`` backend (for re-tokenization matching,
:mod:`redlite.core.same_bytes`).

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) write each byte as one printable
character (GPT-2's byte-to-unicode table); SentencePiece-style vocabularies write a space as
``▁`` and a raw byte as ``<0xNN>``. Other decoders: a token's bytes are its decoded text, when
that is whole characters. Special tokens (and any token whose bytes cannot be told) give None.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable character -> the byte it stands for.
    Bytes that are printable Latin-1 characters stand for themselves; the others (controls,
    space, a few Latin-1 gaps) are written as the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_kinds(backend: Any) -> set[str]:
    """The ``type`` names of the backend's decoder (and of its steps, for a Sequence), from
    the decoder's own JSON (not the whole tokenizer's: megabytes for a large vocabulary)."""
    try:
        state = backend.decoder.__getstate__() if backend.decoder is not None else b"{}"
        decoder = json.loads(state) or {}
    except (ValueError, AttributeError, TypeError):
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except (ValueError, AttributeError):
            return set()
    steps = decoder.get("decoders") or [decoder]
    return {str(step.get("type")) for step in steps if isinstance(step, dict)}


class TokenBytes:
    """``token_bytes(id) -> bytes | None`` for one ``tokenizers.Tokenizer`` (cached per id;
    thread-safe: a race computes the same value twice)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        kinds = _decoder_kinds(backend)
        self._byte_level = byte_level_table() if "ByteLevel" in kinds else None
        self._metaspace = bool(kinds & {"Metaspace", "Replace", "ByteFallback"})
        added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else {}
        self._special = {int(i) for i, token in added.items() if getattr(token, "special", False)}
        self._added = {int(i): str(token.content) for i, token in added.items()}
        self._cache: dict[int, bytes | None] = {}

    def __call__(self, token_id: int) -> bytes | None:
        token_id = int(token_id)
        try:
            return self._cache[token_id]
        except KeyError:
            pass
        value = self._compute(token_id)
        self._cache[token_id] = value
        return value

    def _compute(self, token_id: int) -> bytes | None:
        if token_id in self._special:
            return None
        if token_id in self._added:  # a non-special added token is its text
            return self._added[token_id].encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level is not None:
            try:
                return bytes(self._byte_level[c] for c in piece)
            except KeyError:
                return None
        if self._metaspace:
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        text = self._backend.decode([token_id], skip_special_tokens=False)
        return None if "\ufffd" in text else text.encode("utf-8")
