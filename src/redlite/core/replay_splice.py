"""Splicing kept turns into a rendered prompt (see :mod:`redlite.core.replay`).

:func:`render_with_replay` renders the conversation through the chat template once, with each
recognised assistant message replaced by a bare message whose content is a unique marker. In
that text, for each marker:

* the turn's header is the last occurrence (within the turn) of the longest start of the kept
  generation prompt, e.g. ``<|im_start|>assistant\\n`` (a template's history header may add an
  empty ``<think></think>`` block after it; that is dropped with the header);
* the footer is the text right after the marker (``<|im_end|>\\n``, ``<|eot_id|>``...).

The prompt ids are the template tokenization of the text pieces between turns, with each turn
replaced by its kept generation-prompt ids + answer ids. Checked, not assumed: the pieces and
the marked turns tokenized one by one must concatenate to the template's own tokenization of
the marked text (cuts fall on special tokens); otherwise the plain template render is used
(logged). Message boundaries are mapped from the marked render into the spliced ids when first
read (the first token does not wait for them).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from typing import Any, Callable

from redlite.core.chat import ChatRequest
from redlite.core.replay import GeneratedTurn, ReplayStore
from redlite.core.tokenizer import MARKER_LEAD, RenderedPrompt, message_texts

log = logging.getLogger("redlite.replay")

#: the marker of a spliced turn in the marked render (per process; a request holding it gets another)
_TAG = f"{MARKER_LEAD}<replay-{secrets.token_hex(6)}-"
_HEADER_SLACK = 64  # characters a history header may hold beyond the kept generation prompt


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered template text, as ``render_chat`` tokenizes it (no BOS added)."""
    encoder = getattr(tokenizer, "encode_rendered", None)
    return list(encoder(text)) if encoder is not None else list(tokenizer.encode(text))


def decode_rendered(tokenizer: Any, ids: list[int]) -> str:
    """Text of ``ids`` with special tokens written out (the template's markup)."""
    decoder = getattr(tokenizer, "decode_rendered", None)
    return decoder(ids) if decoder is not None else tokenizer.decode(ids)


def header_start(before: str, prefix_text: str) -> int | None:
    """Where the turn's header begins in ``before`` (the text up to the marker): the last
    occurrence of the longest start of ``prefix_text`` within the last ``len(prefix_text) +
    64`` characters that reaches past the role name ``assistant`` (the whole of it when it does
    not name the role); None when not found."""
    window = max(0, len(before) - len(prefix_text) - _HEADER_SLACK)
    role = prefix_text.find("assistant")
    shortest = role + len("assistant") if role >= 0 else len(prefix_text)
    for k in range(len(prefix_text), max(shortest, 1) - 1, -1):
        at = before.rfind(prefix_text[:k], window)
        if at >= 0:
            return at
    return None


def render_with_replay(tokenizer: Any, request: ChatRequest, store: ReplayStore | None,
                       render: Callable[[Any, ChatRequest], Any]) -> tuple[Any, int]:
    """(rendered prompt, number of spliced turns). ``render(tokenizer, request)`` is the plain
    template render (:func:`redlite.core.chat_render.render_request`); it is what is returned
    when no turn is recognised or the splice does not check out."""
    found: dict[int, GeneratedTurn] = {}
    if store is not None and len(store):
        for i, message in enumerate(request.messages):
            if isinstance(message, dict) and message.get("role") == "assistant":
                turn = store.find(message, request.messages[i - 1] if i else None)
                if turn is not None:
                    found[i] = turn
    if not found:
        return render(tokenizer, request), 0
    tag = _TAG  # the same each time: the marked render then shares its prefix with the last one
    if any(MARKER_LEAD in text and tag in text for text in message_texts(request.messages)):
        tag = f"{MARKER_LEAD}<replay-{secrets.token_hex(6)}-"
    messages = [{"role": "assistant", "content": f"{tag}{i}>"} if i in found else m
                for i, m in enumerate(request.messages)]
    marked = render(tokenizer, replace(request, messages=messages))
    spliced = _splice(tokenizer, marked, [(f"{tag}{i}>", found[i]) for i in sorted(found)])
    if spliced is None:
        log.info("%s replay: splice did not check out; template render", request.request_id)
        return render(tokenizer, request), 0
    return spliced, len(found)


def _splice(tokenizer: Any, marked: Any, turns: list[tuple[str, GeneratedTurn]]) -> RenderedPrompt | None:
    text = marked.text
    pieces: list[str] = []        # text between turns
    regions: list[str] = []       # the marked text of each turn (header + marker)
    cursor = 0
    for marker, turn in turns:
        at = text.find(marker, cursor)
        if at < 0:
            return None
        # only the end of the text before the marker can hold the header (not a copy of it all)
        window = max(cursor, at - len(turn.prefix_text) - _HEADER_SLACK)
        start = header_start(text[window:at], turn.prefix_text)
        if start is None:
            return None
        start += window - cursor
        pieces.append(text[cursor:cursor + start])
        regions.append(text[cursor + start:at + len(marker)])
        cursor = at + len(marker)
    pieces.append(text[cursor:])
    split = _split_at_cuts(marked, pieces, regions)
    if split is not None:
        piece_ids, region_ids = split
    else:
        piece_ids = [encode_rendered(tokenizer, p) for p in pieces]
        region_ids = [encode_rendered(tokenizer, r) for r in regions]
        check: list[int] = []
        for k, ids in enumerate(piece_ids):
            check += ids
            if k < len(region_ids):
                check += region_ids[k]
        if check != list(marked.token_ids):
            return None
    ids: list[int] = []
    out_text: list[str] = []
    # (marked start, marked end, spliced start) of each piece, for the boundary mapping
    spans: list[tuple[int, int, int]] = []
    marked_at = 0
    for k, piece in enumerate(piece_ids):
        spans.append((marked_at, marked_at + len(piece), len(ids)))
        if k:
            ids += piece
        else:
            ids = piece  # a fresh list
        out_text.append(pieces[k])
        marked_at += len(piece)
        if k < len(turns):
            turn = turns[k][1]
            ids += turn.prefix_ids + turn.answer_ids
            out_text.append(turn.prefix_text + tokenizer.decode(turn.answer_ids))
            marked_at += len(region_ids[k])
    return RenderedPrompt(ids, lambda: _mapped_ends(marked.message_ends, spans), "".join(out_text))


def _mapped_ends(marked_ends: list[int], spans: list[tuple[int, int, int]]) -> list[int]:
    """The marked render's message boundaries that fall in a piece between turns, moved to
    the spliced ids (``spans``: each piece's marked start, marked end and spliced start)."""
    ends = []
    for end in marked_ends:
        for lo, hi, at in spans:
            if lo < end <= hi:
                ends.append(end - lo + at)
                break
    return ends


def _split_at_cuts(marked: Any, pieces: list[str], regions: list[str]) -> tuple[list, list] | None:
    """The marked ids of each piece and region, sliced where the marked prompt's ids split
    exactly (its ``cut_count``); None when it cannot tell or a cut falls inside a token."""
    cut_count = getattr(marked, "cut_count", None)
    if cut_count is None:
        return None
    counts, at = [0], 0
    for k, piece in enumerate(pieces):
        at += len(piece)
        counts.append(cut_count(at))
        if k < len(regions):
            at += len(regions[k])
            counts.append(cut_count(at))
    if None in counts:
        return None
    ids = marked.token_ids
    slices = [ids[a:b] for a, b in zip(counts, counts[1:])]
    return slices[0::2], slices[1::2]
