"""Exact replay: what the server generated, kept so a later prompt holds it token for token.

Agents send the model's own turn back in another form than it was generated: tool-call
arguments re-serialized (sorted keys, other whitespace), reasoning dropped, a template that
drops earlier reasoning, or text that re-tokenizes differently. Rendered through the template,
such a turn diverges from the held ids and everything after it is prefilled again.

With ``--replay exact`` (the default) the server keeps, per answer, a :class:`GeneratedTurn`
(the generation prompt's ids, the exact answer ids, the parsed content / reasoning / tool
calls) in a :class:`ReplayStore` (RAM, LRU within a byte budget). The turns a conversation
holds go with it when it is parked (RAM entry) or saved (disk session file, as
:meth:`GeneratedTurn.to_record` objects in its header); a restarted server seeds its store from
the files' headers, and a restored conversation puts its turns back in the store, so exact
replay survives eviction and restarts. A history assistant message is
*recognised* (:func:`matches`) when one of its tool-call ids names a kept turn, or its content
and calls (arguments compared as parsed JSON, so key order and whitespace do not matter) equal
a kept turn's; its reasoning must equal the kept one's or be absent (a client that drops it).
A recognised turn is then spliced (:mod:`redlite.core.replay_splice`): the model sees its turn
exactly as it generated it (reasoning included, even where the template would drop it), so the
held ids are a prefix of the new prompt. Anything not recognised renders through the template
as before. ``--replay template``: the store is not used; every turn renders through the template.

torch-free; pure except for the store.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

REPLAY_MODES = ("exact", "template")

#: the most tokens a generation prompt (text after the last message boundary) may hold for its
#: answer to be kept: a longer tail means the last boundary was not found
MAX_PREFIX_TOKENS = 64


def canonical_arguments(arguments: object) -> str:
    """Tool-call arguments as canonical JSON text (sorted keys, no spaces); text that is not
    JSON is returned stripped, unchanged otherwise."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_calls(message: dict) -> tuple[tuple[str, str], ...]:
    """(name, canonical arguments) of an OpenAI-shaped assistant message's tool calls."""
    out = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        out.append((str(function.get("name")), canonical_arguments(function.get("arguments", {}))))
    return tuple(out)


def context_key(message: object) -> str:
    """What identifies the message a turn answered (role + content), so equal answers to
    different messages stay apart; "" for none."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str)
    role, call_id = message.get("role"), message.get("tool_call_id")
    key = (role, call_id, text)
    if not all(v is None or type(v) is str for v in key):
        return _context_digest(*key)
    return _DIGESTS.get(key)


def _context_digest(role: object, call_id: object, text: str) -> str:
    blob = json.dumps([role, call_id, text], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class _Digests:
    """:func:`context_key` s of recent messages by ``(role, tool_call_id, text)``, keeping at
    most ``max_chars`` of text alive (thread-safe): a turn's context is hashed when the turn is
    recorded and again each time it comes back."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.chars = max_chars, 0
        self._digests: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> str:
        with self._lock:
            digest = self._digests.get(key)
            if digest is not None:
                self._digests.move_to_end(key)
                return digest
        digest = _context_digest(*key)
        with self._lock:
            if key not in self._digests:
                self._digests[key] = digest
                self.chars += len(key[2])
            while self.chars > self.max_chars and self._digests:
                old, _ = self._digests.popitem(last=False)
                self.chars -= len(old[2])
        return digest


_DIGESTS = _Digests(8 << 20)


def content_key(content: str, calls: tuple) -> str:
    """The lookup key of a turn's visible part: stripped content + canonical calls."""
    blob = json.dumps([content.strip(), list(calls)], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass
class GeneratedTurn:
    """One generated answer. prefix_ids / prefix_text: the prompt's generation prompt (after
    its last message boundary); answer_ids: every generated
    token id, the end-of-turn token excluded; content, reasoning, calls: the parsed answer
    (calls as ``(id, name, canonical arguments)``); context: :func:`context_key` of the
    request's last message (the one this turn answered)."""

    prefix_ids: list[int]
    prefix_text: str
    answer_ids: list[int]
    content: str
    reasoning: str
    calls: tuple[tuple[str, str, str], ...] = ()
    context: str = ""
    position: int = -1
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = content_key(self.content, tuple((n, a) for _, n, a in self.calls)) + self.context

    def to_record(self) -> dict:
        """A JSON-ready dict (what a session file's header holds)."""
        return {"prefix_ids": self.prefix_ids, "prefix_text": self.prefix_text,
                "answer_ids": self.answer_ids, "content": self.content,
                "reasoning": self.reasoning, "calls": [list(c) for c in self.calls],
                "context": self.context, "position": self.position}

    @classmethod
    def from_record(cls, record: dict) -> "GeneratedTurn":
        """The turn of a :meth:`to_record` dict. Raises ValueError / KeyError / TypeError for
        a malformed one."""
        calls = tuple((str(i), str(n), str(a)) for i, n, a in record["calls"])
        return cls([int(t) for t in record["prefix_ids"]], str(record["prefix_text"]),
                   [int(t) for t in record["answer_ids"]], str(record["content"]),
                   str(record["reasoning"]), calls, str(record["context"]),
                   int(record.get("position", -1)))

    def held_in(self, ids: list[int]) -> bool:
        """Whether ``ids`` (a conversation's held ids) hold this turn at its position."""
        at, n = self.position, len(self.prefix_ids)
        end = at + n + len(self.answer_ids)
        return (0 <= at and end <= len(ids) and ids[at + n] == self.answer_ids[0]
                and ids[at:end] == self.prefix_ids + self.answer_ids)

    @property
    def nbytes(self) -> int:
        text = len(self.content) + len(self.reasoning) + len(self.prefix_text)
        return 8 * (len(self.prefix_ids) + len(self.answer_ids)) + text + sum(
            len(a) + len(n) + len(i) for i, n, a in self.calls) + 200


def matches(message: dict, turn: GeneratedTurn) -> bool:
    """Whether the history ``message`` is ``turn`` as the client sends it back: same stripped
    content, same calls (names, parsed arguments, order), reasoning equal or absent."""
    if message.get("role") != "assistant":
        return False
    content = message.get("content")
    if not isinstance(content, str):
        content = "" if content is None else None
    if content is None or content.strip() != turn.content.strip():
        return False
    if message_calls(message) != tuple((n, a) for _, n, a in turn.calls):
        return False
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return not reasoning or str(reasoning).strip() == turn.reasoning.strip()


class ReplayStore:
    """Kept turns, least recently used first out when over ``budget_bytes``. Lookup by
    tool-call id, else by :func:`content_key` and the :func:`context_key` of the message before
    it (equal answers to different messages are different turns). Thread-safe (one lock): turns
    are recorded and found on the request threads, collected on the engine worker thread."""

    def __init__(self, budget_bytes: int = 64 << 20) -> None:
        self.budget_bytes = budget_bytes
        self._turns: OrderedDict[str, GeneratedTurn] = OrderedDict()
        self._by_call: dict[str, str] = {}
        self.nbytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def record(self, turn: GeneratedTurn) -> None:
        """Keep ``turn`` (the most recently used), dropping the least recently used turns
        beyond the budget; a turn larger than the budget is not kept."""
        with self._lock:
            self._record(turn)

    def restore(self, turns: list[GeneratedTurn]) -> int:
        """Put back ``turns`` (oldest first) of a restored conversation or a saved file; those
        kept already are only marked used. Returns how many were added."""
        added = 0
        with self._lock:
            for turn in turns:
                if turn.key in self._turns:
                    self._turns.move_to_end(turn.key)
                elif turn.answer_ids and turn.nbytes <= self.budget_bytes:
                    self._record(turn)
                    added += 1
        return added

    def turns_in(self, ids: list[int], budget_bytes: int | None = None) -> list[GeneratedTurn]:
        """The kept turns ``ids`` (a conversation's held ids) hold, by position, within
        ``budget_bytes`` (default: the store's budget; the last ones are kept)."""
        with self._lock:
            turns = [t for t in self._turns.values() if t.answer_ids and t.held_in(ids)]
        turns.sort(key=lambda t: t.position)
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        out, total = [], 0
        for turn in reversed(turns):
            total += turn.nbytes
            if total > budget:
                break
            out.append(turn)
        return out[::-1]

    def _record(self, turn: GeneratedTurn) -> None:
        if turn.nbytes > self.budget_bytes:
            return
        old = self._turns.pop(turn.key, None)
        if old is not None:
            self._forget(old)
        self._turns[turn.key] = turn
        self.nbytes += turn.nbytes
        for call_id, _, _ in turn.calls:
            self._by_call[call_id] = turn.key
        while self.nbytes > self.budget_bytes:
            _, oldest = self._turns.popitem(last=False)
            self._forget(oldest)

    def _forget(self, turn: GeneratedTurn) -> None:
        self.nbytes -= turn.nbytes
        for call_id, _, _ in turn.calls:
            if self._by_call.get(call_id) == turn.key:
                del self._by_call[call_id]

    def find(self, message: dict, previous: object = None) -> GeneratedTurn | None:
        """The kept turn ``message`` is (see :func:`matches`), or None. previous: the message
        before it in the history (for the content lookup)."""
        if message.get("role") != "assistant":
            return None
        keys = [self._by_call.get(str(c.get("id"))) for c in message.get("tool_calls") or []]
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        keys.append(content_key(text, message_calls(message)) + context_key(previous))
        with self._lock:
            for key in keys:
                turn = self._turns.get(key) if key else None
                if turn is not None and matches(message, turn):
                    self._turns.move_to_end(key)
                    return turn
        return None
