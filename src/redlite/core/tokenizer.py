"""What the server core needs from a tokenizer (torch-free protocol).

Two implementations: :class:`redlite.core.byte_tokenizer.ByteTokenizer` (the echo engine's,
UTF-8 bytes) and ``redlite.loading.tokenizer.HFTokenizer`` (transformers/tokenizers, used with
the torch engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat prompt rendered by the chat template and tokenized.

    token_ids: the prompt's token ids (list[int]).
    message_ends: token positions (counts of tokens) at which each message's rendering ends,
        ascending, each <= len(token_ids); used as checkpoint positions for hybrid models.
    text: the rendered text (for logs and debugging).
    """

    token_ids: list[int]
    message_ends: list[int]
    text: str


class IncrementalDecoder(Protocol):
    """Turns generated token ids into text, one token at a time.

    ``push`` returns only complete text: bytes of a character split across tokens are held
    back until the character is complete, never emitted as U+FFFD or half-sent.
    """

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """Tokenizer + chat template of the served model."""

    vocab_size: int
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Tokenize a raw completion prompt (adds BOS where the model's config asks for it)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        ...

    def render_chat(self, messages: list[dict]) -> RenderedPrompt:
        """Render ``messages`` (dicts with ``role`` and string ``content``) with the chat
        template, adding the assistant generation prompt; tokenize without adding specials
        twice."""
        ...

    def incremental_decoder(self) -> IncrementalDecoder: ...
