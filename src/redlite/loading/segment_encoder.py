"""Tokenizing long chat prompts in cached pieces, cut right before special tokens.

A ``tokenizers`` pipeline first splits its input on added tokens and then normalizes,
pre-tokenizes and tokenizes each piece between them on its own. So when no normalizer runs,
the pre-tokenizer adds nothing at the start of a piece (no prefix space, no Metaspace) and no
added token strips its neighbours (``lstrip``/``rstrip``/``single_word``), the tokens of a text
are exactly the tokens of its pieces cut right before each special token, concatenated.
:class:`SegmentEncoder` uses that to (1) tokenize the pieces of a chat prompt in one
``encode_batch`` call (parallel, and without the GIL; a few short pieces on the calling thread)
and (2) keep recent pieces' tokens: an
agent resends its whole conversation every turn, and only the new messages are then tokenized.
For a tokenizer where cutting would not be exact, every text is tokenized whole.

Text given as *plain spans* (special-token strings that came from a request's content, see
:mod:`redlite.loading.plain_specials`) is tokenized as ordinary text: the text is cut before
the other (the template's) special tokens only, and each piece after its leading special token
is tokenized by a copy of the tokenizer that reads special tokens as text.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from typing import Any

import numpy as np

from redlite.loading.plain_specials import special_strings
from redlite.loading.text_pieces import Pieces

#: pre-tokenizers that treat each piece on its own without adding to its start
_LOCAL_PRE_TOKENIZERS = {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
                         "UnicodeScripts", "BertPreTokenizer"}


def _cut_tokens(backend: Any) -> list[str] | None:
    """The special tokens before which a text may be cut (longest first), or None when cutting
    is not exact for this tokenizer (see the module docstring)."""
    if backend.normalizer is not None:
        return None
    # the pre-tokenizer's own JSON (its pickled state), not the whole tokenizer's (~0.2 s)
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else None
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel" and step.get("add_prefix_space"):
            return None
        if kind != "ByteLevel" and kind not in _LOCAL_PRE_TOKENIZERS:
            return None
    specials = []
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word:
            return None
        if token.special and token.content:
            specials.append(token.content)
    if not specials:
        return None
    return sorted(specials, key=len, reverse=True)


def _no_straddle(tokens: list[str]) -> bool:
    """Whether no token's occurrence can start inside another's and reach past that one's end
    while a token starts there: no token's proper suffix is a prefix of a token or has one as
    a prefix. Then a text scanned for the tokens left to right is cut at a position where one
    starts whatever follows."""
    whole = set(tokens)
    starts = {y[:i] for y in tokens for i in range(1, len(y) + 1)}
    for x in tokens:
        for k in range(1, len(x)):
            tail = x[k:]
            if tail in starts or any(tail[:i] in whole for i in range(1, len(tail))):
                return False
    return True


#: at most this many characters to tokenize are tokenized on the calling thread
_SHORT_CHARS = 4096


def _encode_many(backend: Any, texts: list[str]) -> list:
    """``backend``'s encodings of ``texts`` (no added specials): ``encode_batch`` (parallel,
    without the GIL) unless they are short (a new message: waking the tokenizer's thread pool
    costs more than the work)."""
    if sum(map(len, texts)) <= _SHORT_CHARS:
        return [backend.encode(text, add_special_tokens=False) for text in texts]
    return backend.encode_batch(texts, add_special_tokens=False)


def _offsets_array(offsets: list) -> np.ndarray:
    return np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


class SegmentEncoder:
    """Token ids and char offsets of texts, through cached pieces (thread-safe).

    backend: a ``tokenizers.Tokenizer``. max_chars: the most characters of pieces kept.
    recent: how many texts given to :meth:`encode_pieces` with ``remember`` are kept to
    continue from (:mod:`redlite.loading.text_pieces`).
    """

    def __init__(self, backend: Any, max_chars: int = 16 << 20, recent: int = 6) -> None:
        self._backend = backend
        self._cut_tokens = _cut_tokens(backend)
        self._cut = (re.compile("|".join(re.escape(s) for s in self._cut_tokens))
                     if self._cut_tokens else None)
        self._max_chars = max_chars
        self._cache: collections.OrderedDict[str, tuple[list[int], np.ndarray]] = \
            collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        specials = special_strings(backend)
        self._specials = re.compile("|".join(re.escape(s) for s in specials)) if specials else None
        self._plain: Any = None
        # recent texts by piece, to continue from (only where no special token can straddle a
        # cut point: then the scan up to a shared cut point is the same in both texts)
        self._recent: collections.deque[Pieces] | None = None
        if self._cut is not None and _no_straddle(self._cut_tokens):
            self._recent = collections.deque(maxlen=recent)

    @property
    def cuts(self) -> bool:
        """Whether texts are cut into pieces (False: each is tokenized whole)."""
        return self._cut is not None

    def min_tokens(self, text: str, max_token_chars: int | None) -> int:
        """A lower bound on the tokens of ``text``, found without tokenizing it: each special
        token in it is one token, and one token covers at most ``max_token_chars`` of the
        other characters. 0 when this tokenizer is not cut into pieces (no such bound)."""
        if self._cut is None:
            return 0
        specials = special_chars = 0
        for match in self._cut.finditer(text):
            specials += 1
            special_chars += match.end() - match.start()
        rest = len(text) - special_chars
        return specials + (-(-rest // max_token_chars) if max_token_chars else 0)

    def over_limit(self, text: str, limit: int, max_token_chars: int | None) -> int | None:
        """:meth:`min_tokens` of ``text`` when it exceeds ``limit`` (the text provably has more
        tokens), else None. The scan for special tokens is skipped where it cannot decide: that
        bound exceeds the plain ``len / max_token_chars`` by at most one per special token, and
        a text holds at most ``len / (shortest special token)`` of them."""
        if self._cut is None or not max_token_chars:
            return None
        chars = len(text)
        if -(-chars // max_token_chars) + chars // min(map(len, self._cut_tokens)) <= limit:
            return None
        at_least = self.min_tokens(text, max_token_chars)
        return at_least if at_least > limit else None

    def encode_text(self, text: str) -> list[int]:
        """Ids of ``text`` with every special-token string in it tokenized as plain text (as
        message content is, :mod:`redlite.loading.plain_specials`)."""
        spans = [m.span() for m in self._specials.finditer(text)] if self._specials is not None else []
        return self.encode(text, spans, offsets=False)[0]

    def encode(self, text: str, plain: list[tuple[int, int]] = (),
               offsets: bool = True) -> tuple[list[int], np.ndarray | None]:
        """``(ids, offsets)`` of ``text`` without added specials: the ids exactly as
        ``backend.encode(text, add_special_tokens=False)`` gives them; offsets an int64 array of
        shape [len(ids), 2], each row the (start, end) character positions in ``text`` (None
        when ``offsets`` is False: ids only, without the array work).
        plain: ascending, disjoint ``(start, end)`` character ranges of special-token strings
        to tokenize as text (see the module docstring; not cached)."""
        if plain:
            ids, array = self._encode_plain(text, plain)
            return ids, array if offsets else None
        if self._cut is None:
            encoding = _encode_many(self._backend, [text])[0]
            return list(encoding.ids), _offsets_array(encoding.offsets) if offsets else None
        pieces = self.encode_pieces(text)
        if not offsets:
            return pieces.ids, None
        array = np.concatenate(pieces.offsets)
        array += np.repeat(np.asarray(pieces.starts, dtype=np.int64), np.diff(pieces.counts + [len(pieces.ids)]))[:, None]
        return pieces.ids, array

    def encode_pieces(self, text: str, remember: bool = False) -> Pieces | None:
        """The :class:`~redlite.loading.text_pieces.Pieces` of ``text`` (ids as :meth:`encode`
        gives them; None when this tokenizer is not cut into pieces). A remembered text that
        ``text`` equals up to a cut point of both is continued from there (only the rest is
        tokenized). remember: keep ``text`` to continue from."""
        if self._cut is None:
            return None
        base, k, start = None, 0, 0
        with self._lock:
            recent = list(self._recent or ())
        for old in recent:
            cut, char = old.shared_cut(text)
            # walk back to a cut point that the new text is cut at too
            while cut > 0 and char < len(text) and not self._cut.match(text, char):
                cut -= 1
                char = old.starts[cut]
            if char > start:
                base, k, start = old, cut, char
            if len(text) - start <= _SHORT_CHARS:  # good enough: any shared cut gives the same ids
                break
        suffix = self._pieces_from(text, start)
        pieces = suffix if base is None else base.continued(k, text, suffix)
        if remember and self._recent is not None:
            with self._lock:
                self._recent.appendleft(pieces)
        return pieces

    def _pieces_from(self, text: str, start: int) -> Pieces:
        """The pieces of ``text[start:]`` (positions relative to ``start``)."""
        starts = [start] + [m.start() for m in self._cut.finditer(text, start) if m.start() > start]
        spans = list(zip(starts, starts[1:] + [len(text)]))
        pieces = [text[a:b] for a, b in spans]
        found: dict[str, tuple[list[int], np.ndarray]] = {}
        with self._lock:
            for piece in pieces:
                hit = self._cache.get(piece)
                if hit is not None:
                    self._cache.move_to_end(piece)
                    found[piece] = hit
        missing = list({piece: None for piece in pieces if piece not in found})
        if missing:
            encodings = _encode_many(self._backend, missing)
            with self._lock:
                for piece, encoding in zip(missing, encodings):
                    found[piece] = (list(encoding.ids), _offsets_array(encoding.offsets))
                    self._remember(piece, found[piece])
        ids: list[int] = []
        counts: list[int] = []
        for piece in pieces:
            counts.append(len(ids))
            ids.extend(found[piece][0])
        return Pieces(text[start:] if start else text, ids, [a - start for a in starts], counts,
                      [found[piece][1] for piece in pieces])

    def _encode_plain(self, text: str, plain: list[tuple[int, int]]) -> tuple[list[int], np.ndarray]:
        if self._plain is None:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(self._backend.to_str())
            copy.encode_special_tokens = True  # special-token text is tokenized as text
            self._plain = copy
        spans = iter(plain)
        span = next(spans, None)
        markup: list[tuple[int, int]] = []  # the template's special tokens: the cut points
        for match in self._specials.finditer(text) if self._specials is not None else ():
            while span is not None and span[1] <= match.start():
                span = next(spans, None)
            if span is None or match.end() <= span[0]:
                markup.append((match.start(), match.end()))
        starts = [0] + [a for a, _ in markup if a > 0]
        heads = {a: b for a, b in markup}
        rests = [(heads.get(a, a), b) for a, b in zip(starts, starts[1:] + [len(text)])]
        encodings = _encode_many(self._plain, [text[a:b] for a, b in rests])
        ids: list[int] = []
        parts: list[np.ndarray] = []
        for start, (rest, _), encoding in zip(starts, rests, encodings):
            if rest > start:
                ids.append(int(self._backend.token_to_id(text[start:rest])))
                parts.append(np.asarray([[start, rest]], dtype=np.int64))
            ids.extend(encoding.ids)
            parts.append(_offsets_array(encoding.offsets) + rest)
        return ids, np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)

    def _remember(self, piece: str, value: tuple) -> None:
        if piece in self._cache or len(piece) > self._max_chars // 4:
            return
        self._cache[piece] = value
        self._chars += len(piece)
        while self._chars > self._max_chars:
            old, _ = self._cache.popitem(last=False)
            self._chars -= len(old)
