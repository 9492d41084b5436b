"""Incremental decoding of one generated stream with a ``tokenizers`` backend."""

from __future__ import annotations

import logging
from typing import Any, Sequence

logger = logging.getLogger("redlite.loading")

# Tokens of context kept for a decoder that restarts after flush().
_CONTEXT_TOKENS = 8


class StreamingDecoder:
    """Incremental decoder (:class:`redlite.core.tokenizer.IncrementalDecoder`) of one stream.

    Built on ``tokenizers.decoders.DecodeStream`` with ``skip_special_tokens=True``: a
    character whose UTF-8 bytes are split over several tokens (byte-level BPE pieces,
    ``<0xNN>`` byte-fallback tokens: emoji, CJK, accented letters) is held back until its
    last byte arrives. The concatenation of every ``push`` result and the final ``flush``
    equals ``tokenizer.decode(all pushed ids)``.
    """

    def __init__(self, backend: Any, context_ids: Sequence[int] = ()) -> None:
        """backend: a ``tokenizers.Tokenizer``. context_ids: ids already in the text before
        the first pushed token (e.g. the prompt's tail); they only give the decoder context
        (a leading space of the first pushed token is kept) and are never emitted."""
        self._backend = backend
        self._context = [int(i) for i in context_ids][-_CONTEXT_TOKENS:]
        self._reset()

    def _reset(self) -> None:
        from tokenizers.decoders import DecodeStream

        try:
            self._stream = DecodeStream(ids=self._context or None, skip_special_tokens=True)
        except TypeError:  # tokenizers < 0.22 has no prefill
            self._stream = DecodeStream(skip_special_tokens=True)
            self._context = []
        self._ids: list[int] = []
        self._emitted: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one generated token id; return the text it completes ("" while a character is
        still incomplete, or for a skipped special token)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return ""
        self._emitted.append(chunk)
        return chunk

    def flush(self) -> str:
        """Return the text still held back and end the stream. Later pushes start a new
        stream, with the last few tokens as context unless they end inside a character.
        Only a stream that really ended inside a character yields U+FFFD here, exactly as
        ``decode`` of the same ids does."""
        rest = ""
        if self._ids:
            base = self._backend.decode(self._context, skip_special_tokens=True) if self._context else ""
            full = self._backend.decode(self._context + self._ids, skip_special_tokens=True)
            done = base + "".join(self._emitted)
            if full.startswith(done):
                rest = full[len(done) :]
            else:  # should not happen: the stream's chunks are always a prefix of the full text
                logger.debug("incremental decode diverged from full decode; dropping the held tail")
        context = (self._context + self._ids)[-_CONTEXT_TOKENS:]
        # A tail that cuts a character would garble the next stream's first character.
        clean = "\ufffd" not in self._backend.decode(context, skip_special_tokens=True)
        self._context = context if clean else []
        self._reset()
        return rest
