"""Message boundary positions of a rendered chat, from a few renders instead of one per prefix.

A chat template renders a conversation as one string. For checkpoints (models that cannot
rewind) the server wants, for each message ``i``, the length of the rendering of
``messages[:i+1]`` (without generation prompt) inside the full rendering. Rendering every prefix
is quadratic in the message count; this module finds the same positions from a few renders:

1. one render of the whole conversation in which every message whose content is a non-empty
   string carries a unique *open* marker before its content and a *close* marker after it
   (inside the content's leading/trailing whitespace, so a template's ``trim`` still works);
2. per role, the prefix render that ends at the first marked message ``k`` of that role (the
   last one when the first one's renders do not check out): the text after its close marker is
   that role's *footer* (e.g. ``<|im_end|>\\n``); per pair (previous role, role), the prefix
   renders that end at and just before the first (or last) message ``k`` with that pair: the
   text from the shorter one's end to ``k``'s open marker is that pair's *header* (e.g.
   ``<|im_start|>user\\n``; a tool result after a tool call opens a turn, one after another
   tool result does not);
3. message ``i`` ends at its close marker plus its role's footer when the text there starts with
   that footer; else where message ``i+1``'s header begins, when the text before ``i+1``'s open
   marker ends with that header (this covers an assistant turn whose tool calls follow its
   content, and a tool-call turn with empty content).

What is used is checked, not assumed: with the markers removed, the marked render must be the
start of the real text, and each prefix render must be exactly the start of the next longer one
(up to the marker used); otherwise only what one unmarked render shows is returned (the whole
conversation's end). A message whose footer differs from its role's learned one and whose
successor's header differs from its pair's (say a template that writes each message its own
way) gets no boundary. Cost: one render of the whole conversation, plus short prefix
renders (ending at each role's and role pair's first message), plus, only for a template that
writes a first message differently, up to ``3 * (distinct role pairs)`` longer ones; all linear.
"""

from __future__ import annotations

import collections
import secrets
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from redlite.core.tokenizer import MARKER_LEAD as _LEAD

#: render(messages, add_generation_prompt) -> text (the template's kwargs already bound)
Render = Callable[[list, bool], str]


@dataclass
class _Marked:
    """A marked render with the markers removed: ``text``, and per message index the position
    (in ``text``) of its open and close marker."""

    text: str
    opens: dict[int, int]
    closes: dict[int, int]


def _content(message: object) -> str | None:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) and content.strip() else None


def _space(message: object, leading: bool) -> str:
    """The leading or trailing whitespace of a marked message's content."""
    content = _content(message)
    if content is None:
        return ""
    return content[: len(content) - len(content.lstrip())] if leading else content[len(content.rstrip()):]


def _candidates(found: list[tuple[int, bool]]) -> list[int]:
    """From (index, clean) pairs in order: the first clean index (else the first), then the
    last index."""
    first = next((i for i, clean in found if clean), found[0][0])
    return [first] if found[-1][0] == first else [first, found[-1][0]]


def _marker_prefix(messages: Sequence[dict]) -> str:
    """A marker prefix found in no message's content."""
    while True:
        prefix = f"{_LEAD}<{secrets.token_hex(6)}:"
        if not any(_LEAD in text and prefix in text for text in map(_content, messages) if text):
            return prefix


def _with_markers(messages: Sequence[dict], prefix: str) -> list:
    """Copies of ``messages``, each non-empty string content as ``lead OPEN body CLOSE trail``."""
    out = []
    for i, message in enumerate(messages):
        content = _content(message)
        if content is None:
            out.append(message)
            continue
        body = content.strip()
        lead = content[: len(content) - len(content.lstrip())]
        trail = content[len(content.rstrip()):]
        out.append({**message, "content": f"{lead}{prefix}o{i}>{body}{prefix}c{i}>{trail}"})
    return out


def _strip(text: str, prefix: str) -> _Marked:
    """``text`` without its markers (``{prefix}o{i}>`` / ``{prefix}c{i}>``) and where they were."""
    pieces: list[str] = []
    opens: dict[int, int] = {}
    closes: dict[int, int] = {}
    last = removed = 0
    at = _find(text, prefix, 0)
    while at >= 0:
        end = text.find(">", at + len(prefix))
        tag = text[at + len(prefix):end] if end >= 0 else ""
        if len(tag) < 2 or tag[0] not in "oc" or not tag[1:].isdecimal():
            at = _find(text, prefix, at + 1)
            continue
        pieces.append(text[last:at])
        (opens if tag[0] == "o" else closes)[int(tag[1:])] = at - removed
        removed += end + 1 - at
        last = end + 1
        at = _find(text, prefix, last)
    pieces.append(text[last:])
    return _Marked("".join(pieces), opens, closes)


def _find(text: str, prefix: str, start: int) -> int:
    """``text.find(prefix, start)``, searching for its first character (memchr speed)."""
    at = text.find(prefix[0], start)
    while at >= 0 and not text.startswith(prefix, at):
        at = text.find(prefix[0], at + 1)
    return at


class PrefixRenders:
    """The marked renders (markers removed) of recent conversations' prefixes, by template
    arguments and messages: a conversation that starts with the same messages as a recent one
    renders only its new prefixes (a marked render is the same whatever the markers' random
    part). Thread-safe; ``size``: prefixes kept, least recently used out."""

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._entries: collections.OrderedDict[tuple, tuple[list, _Marked | None]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, extra: Hashable, messages: Sequence[dict], n: int) -> tuple[bool, _Marked | None]:
        """(found, render) of ``messages[:n]`` under template arguments ``extra``."""
        with self._lock:
            hit = self._entries.get((extra, n))
            if hit is not None:
                self._entries.move_to_end((extra, n))
        if hit is not None and hit[0] == list(messages[:n]):
            return True, hit[1]
        return False, None

    def put(self, extra: Hashable, messages: Sequence[dict], n: int, value: _Marked | None) -> None:
        with self._lock:
            self._entries[(extra, n)] = (list(messages[:n]), value)
            self._entries.move_to_end((extra, n))
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)


def message_boundaries(render: Render, messages: Sequence[dict], text: str,
                       memo: tuple[PrefixRenders, Hashable] | None = None) -> list[int]:
    """Character positions in ``text`` (the real rendering, with generation prompt) at which the
    rendering of ``messages[:i+1]`` ends, ascending and distinct; see the module docstring.
    Template errors on the marked or partial conversations drop boundaries, never raise.
    memo: a :class:`PrefixRenders` and the key of ``render``'s template arguments, to reuse and
    keep the prefix renders."""
    if not messages:
        return []
    prefix = _marker_prefix(messages)
    marked = _with_markers(messages, prefix)
    renders: dict[int, _Marked | None] = {}

    def prefix_render(n: int) -> _Marked | None:
        """The marked render of ``messages[:n]`` (cached; None when the template refuses)."""
        if n not in renders:
            found, value = memo[0].get(memo[1], messages, n) if memo and n else (False, None)
            if not found:
                try:
                    value = _strip(render(marked[:n], False), prefix) if n else _Marked("", {}, {})
                except Exception:  # a template may refuse a partial or marked conversation
                    value = None
                if memo and n:
                    memo[0].put(memo[1], messages, n, value)
            renders[n] = value
        return renders[n]

    full = prefix_render(len(messages))
    if full is None or not full.closes or not text.startswith(full.text):
        return _whole_only(render, messages, text)

    roles = [str(m.get("role")) if isinstance(m, dict) else "" for m in messages]
    leads = [_space(m, leading=True) for m in messages]
    trails = [_space(m, leading=False) for m in messages]
    # the message each footer (by role) and header (by previous and own role) is learned from:
    # the first one without the whitespace a template may or may not trim (else the first), so
    # its prefix renders are short; the last one when the first one's renders do not check out
    footer_from: dict[str, list[tuple[int, bool]]] = {}
    header_from: dict[tuple, list[tuple[int, bool]]] = {}
    for i in range(len(messages)):
        if i in full.opens and i in full.closes:
            footer_from.setdefault(roles[i], []).append((i, not trails[i]))
            header_from.setdefault((roles[i - 1] if i else None, roles[i]), []).append((i, not leads[i]))
    footers: dict[str, str] = {}
    for role, found in footer_from.items():
        for k in _candidates(found):
            upto = prefix_render(k + 1)
            if upto is not None and full.text.startswith(upto.text) and k in upto.closes:
                footers[role] = upto.text[upto.closes[k]:]
                break
    headers: dict[tuple, str] = {}
    for pair, found in header_from.items():
        for k in _candidates(found):
            upto, before = prefix_render(k + 1), prefix_render(k)
            if (upto is not None and before is not None and k in upto.opens
                    and full.text.startswith(upto.text[:upto.opens[k]])
                    and upto.text.startswith(before.text)):
                headers[pair] = upto.text[len(before.text):upto.opens[k]]
                break

    bounds: list[int] = []
    for i in range(len(messages)):
        end = None
        footer = footers.get(roles[i])
        if footer is not None and i in full.closes:
            # the content's trailing whitespace lies between marker and footer unless trimmed
            for tail in ((trails[i] + footer, footer) if trails[i] else (footer,)):
                if full.text.startswith(tail, full.closes[i]):
                    end = full.closes[i] + len(tail)
                    break
        if end is None and i + 1 < len(messages) and i + 1 in full.opens:
            header = headers.get((roles[i], roles[i + 1]))
            for head in ((header + leads[i + 1], header) if leads[i + 1] else (header,)) if header else ():
                start = full.opens[i + 1] - len(head)
                if start >= 0 and full.text.startswith(head, start):
                    end = start
                    break
        if end is not None and (not bounds or end > bounds[-1]):
            bounds.append(end)
    if not bounds or bounds[-1] < len(full.text):  # the whole conversation's end
        bounds.append(len(full.text))
    return bounds


def _whole_only(render: Render, messages: Sequence[dict], text: str) -> list[int]:
    """The one boundary that one unmarked render shows exactly: the whole conversation's."""
    try:
        whole = render(list(messages), False)
    except Exception:
        return []
    return [len(whole)] if whole and text.startswith(whole) else []
