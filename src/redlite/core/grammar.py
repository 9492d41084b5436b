"""Compiled constraints: a :class:`~redlite.core.constraints.ConstraintSpec` as a token mask,
through llguidance (torch-free; numpy masks).

:func:`grammar_tokenizer` wraps the served tokenizer for llguidance once (about 1 s for a
Hugging Face tokenizer, then cached on the tokenizer object): a Hugging Face tokenizer
from its ``tokenizers`` pipeline (JSON), the echo engine's byte tokenizer as a 256-byte vocabulary plus its
special tokens. :class:`GrammarMatcher` is one request's parser state: :meth:`allowed` computes
the mask of the next token, :meth:`accept` advances by the sampled token. Once the grammar is
complete, only the end-of-turn tokens are allowed.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import llguidance
import numpy as np

from redlite.core.constraints import ConstraintError, ConstraintSpec

_lock = threading.Lock()
_ATTR = "_redlite_llg_tokenizer"


class _ByteVocabulary:
    """llguidance's tokenizer protocol for :class:`redlite.core.byte_tokenizer.ByteTokenizer`."""

    def __init__(self, tokenizer: Any) -> None:
        from redlite.core.byte_tokenizer import SPECIAL_TOKENS

        specials = sorted(SPECIAL_TOKENS.items(), key=lambda item: item[1])
        self.tokens = [bytes([i]) for i in range(256)] + [name.encode() for name, _ in specials]
        self.tokens += list(getattr(tokenizer, "merged", ()))  # ids 261, ...: multi-byte tokens
        self.special_token_ids = [i for _, i in specials]
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = None
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def grammar_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of ``tokenizer`` (a :class:`redlite.core.tokenizer.Tokenizer`:
    an ``HFTokenizer`` or the ``ByteTokenizer``), cached on it. Its eos tokens are the
    tokenizer's ``eos_token_ids``. Raises TypeError for another kind of tokenizer."""
    cached = getattr(tokenizer, _ATTR, None)
    if cached is not None:
        return cached
    with _lock:
        cached = getattr(tokenizer, _ATTR, None)
        if cached is not None:
            return cached
        eos = sorted(tokenizer.eos_token_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the tokenizers pipeline as JSON, without padding/truncation
            built = llguidance.LLTokenizer(_pipeline_json(backend), eos_token=eos)
        elif type(tokenizer).__name__ == "ByteTokenizer":
            built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)),
                                           eos_token=eos)
        else:
            raise TypeError(f"no grammar support for {type(tokenizer).__name__}")
        try:
            setattr(tokenizer, _ATTR, built)
        except AttributeError:  # a slotted tokenizer: build again next time
            pass
        return built


def _pipeline_json(backend: Any) -> str:
    """``backend`` (a ``tokenizers.Tokenizer``) as JSON without padding or truncation; edited
    only when it has either (parsing and writing the whole JSON again holds the GIL)."""
    if backend.padding is None and backend.truncation is None:
        return backend.to_str()
    spec = json.loads(backend.to_str())
    spec["padding"] = spec["truncation"] = None
    return json.dumps(spec)


def check_constraint(spec: ConstraintSpec, tokenizer: Any = None) -> None:
    """Raise :class:`ConstraintError` (param ``response_format`` for JSON answers, else
    ``tools``) when llguidance rejects the grammar, e.g. an invalid or unsupported schema."""
    llg_tok = grammar_tokenizer(tokenizer) if tokenizer is not None else None
    grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llg_tok)
    if is_error:
        param = "response_format" if spec.kind == "json" else "tools"
        raise ConstraintError(_reason(messages[0] if messages else "?"), param)


def blame_tool(error: ConstraintError, tools: list[dict], tool_format: str | None,
               tokenizer: Any = None) -> ConstraintError:
    """``error`` (llguidance rejected a grammar of calls to ``tools``) naming the first tool
    whose forced call alone is rejected; ``error`` itself when none is alone."""
    from redlite.core.constraints import build_constraint

    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            continue
        try:
            spec = build_constraint(None, [tool], name, tool_format)
            if spec is not None:
                check_constraint(spec, tokenizer)
        except ConstraintError as alone:
            return ConstraintError(f"tool {name!r}: {alone}", error.param)
    return error


def _reason(llguidance_error: str) -> str:
    """The client's message for a rejected grammar: llguidance's reason, without the position
    in and the listing of our generated grammar (internals, not the request's)."""
    first = llguidance_error.strip().splitlines()[0] if llguidance_error.strip() else "?"
    return "cannot build the output grammar: " + re.sub(r"^at \d+\(\d+\): ", "", first)


class GrammarMatcher:
    """One request's grammar state over ``llg_tokenizer``'s vocabulary.

    allowed(vocab) -> numpy bool [vocab]: the tokens the grammar accepts next (ids beyond the
    tokenizer's vocabulary, a model's padding rows, are never allowed). accept(token): advance;
    a token the grammar rejects puts the matcher in an error state (``error`` says why), after
    which every token is allowed again (the answer is then reported as it is).
    """

    def __init__(self, spec: ConstraintSpec, llg_tokenizer: llguidance.LLTokenizer) -> None:
        self.spec = spec
        self._vocab = int(llg_tokenizer.vocab_size)
        grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
        self._matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(_reason(self._matcher.get_error()),
                                  "response_format" if spec.kind == "json" else "tools")
        self._bits = np.full((self._vocab + 31) // 32, -1, dtype=np.int32)

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""

    @property
    def done(self) -> bool:
        """Whether the grammar is complete (only end-of-turn may follow)."""
        return self._matcher.is_stopped() or self._matcher.is_accepting()

    def allowed(self, vocab_size: int) -> np.ndarray:
        out = np.zeros(vocab_size, dtype=bool)
        if self._matcher.is_error():
            out[:] = True
            return out
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        n = min(vocab_size, self._vocab)
        out[:n] = bits[:n].astype(bool)
        return out

    def accept(self, token: int) -> None:
        if not self._matcher.is_error():
            self._matcher.consume_token(int(token))
