"""The echo engine's tokenizer: one token per UTF-8 byte plus four special tokens.

Ids 0-255 are bytes; 256 ``<|system|>``, 257 ``<|user|>``, 258 ``<|assistant|>``,
259 ``<|end|>`` (end of turn). The chat template renders each message as
``<|role|>content<|end|>`` and ends with ``<|assistant|>``.
"""

from __future__ import annotations

import codecs
import re
from typing import Sequence

from redlite.core.tokenizer import RenderedPrompt

SPECIAL_TOKENS = {"<|system|>": 256, "<|user|>": 257, "<|assistant|>": 258, "<|end|>": 259}
ROLE_TOKENS = {"system": 256, "user": 257, "assistant": 258}
USER, ASSISTANT, END = 257, 258, 259
VOCAB_SIZE = 260
_SPECIAL_PATTERN = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))


class _ByteDecoder:
    """Incremental UTF-8 decoding: an incomplete character is held until complete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            return ""
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        """End of generation: an incomplete trailing character is dropped, not sent as U+FFFD
        (as with the tokenizers library's DecodeStream, which never emits it)."""
        pending, _ = self._decoder.getstate()
        self._decoder.reset()
        return pending.decode("utf-8", errors="ignore")


class ByteTokenizer:
    """UTF-8 byte tokenizer (see module docstring); special-token strings in raw text are
    encoded as their special ids."""

    vocab_size = VOCAB_SIZE
    eos_token_ids = frozenset({END})
    max_token_chars = max(len(s) for s in SPECIAL_TOKENS)  # a byte is at most one character

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        position = 0
        for match in _SPECIAL_PATTERN.finditer(text):
            ids.extend(text[position:match.start()].encode("utf-8"))
            ids.append(SPECIAL_TOKENS[match.group()])
            position = match.end()
        ids.extend(text[position:].encode("utf-8"))
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], **template_kwargs) -> RenderedPrompt:
        ids: list[int] = []
        ends: list[int] = []
        for message in messages:
            ids.append(ROLE_TOKENS.get(message["role"], USER))
            ids.extend(message["content"].encode("utf-8"))
            ids.append(END)
            ends.append(len(ids))
        ids.append(ASSISTANT)
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"
        return RenderedPrompt(ids, ends, text)

    def incremental_decoder(self) -> _ByteDecoder:
        return _ByteDecoder()
