"""Log-probability records (:class:`~redlite.engine.base.TokenLogprob`) in the OpenAI shapes.

* Chat completions (``choices[i].logprobs``, and per streamed chunk for the chunk's tokens):
  ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}``.
* Legacy completions (``choices[i].logprobs``): ``{"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}], "text_offset"}``; ``top_logprobs`` holds the asked
  number of alternatives plus the chosen token (as OpenAI's and vLLM's do), ``text_offset`` the
  character offset of each token in the choice's text.

A token's text is its own bytes (exact for byte-level BPE pieces, from llguidance's view of the
vocabulary) decoded as UTF-8, a piece of a character as U+FFFD; ``bytes`` are the exact bytes.
Special tokens are shown by name.
"""

from __future__ import annotations

from typing import Any, Iterable

from redlite.engine.base import TokenLogprob


class TokenTexts:
    """Token id -> (text, bytes) of the served tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        from redlite.core.grammar import grammar_tokenizer

        self._llg = grammar_tokenizer(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = bytes(self._llg.decode_bytes([int(token_id)]))
            if raw.startswith(b"\xff"):  # llguidance's marker of a special token
                raw = raw[1:]
            found = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found


def chat_entry(record: TokenLogprob, texts: TokenTexts) -> dict:
    """One ``logprobs.content`` entry."""
    text, raw = texts.get(record.token_id)
    top = []
    for token_id, logprob in record.top:
        alt_text, alt_raw = texts.get(token_id)
        top.append({"token": alt_text, "logprob": logprob, "bytes": alt_raw})
    return {"token": text, "logprob": record.logprob, "bytes": raw, "top_logprobs": top}


def chat_logprobs(records: Iterable[TokenLogprob], texts: TokenTexts) -> dict:
    """``choices[i].logprobs`` of a chat completion (or of one chunk's tokens)."""
    return {"content": [chat_entry(r, texts) for r in records], "refusal": None}


def completion_logprobs(records: Iterable[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a legacy completion; ``offset``: characters of the choice's
    text before the first record (for streamed chunks)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for record in records:
        text, _ = texts.get(record.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(record.logprob)
        top = {texts.get(t)[0]: lp for t, lp in record.top}
        top.setdefault(text, record.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def choices_usage(usages: list) -> Any:
    """One usage for ``n`` choices (objects with ``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens``): the prompt counted once, the completions summed, the reuse of the
    first choice (later ones reuse the prompt the first one read), as OpenAI reports ``n``."""
    first = usages[0]
    if len(usages) == 1:
        return first
    return type(first)(first.prompt_tokens, sum(u.completion_tokens for u in usages),
                       first.cached_tokens)
