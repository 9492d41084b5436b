"""Conversation affinity: which replica should serve a request (pure, Ray-free).

Key (:func:`conversation_key`): the client's session key (the one rule of
:mod:`redlite.server.session_key`: session headers, else the wire's body field), else a hash of
the conversation's stable prefix: its system text and first user message (chat, Anthropic,
Responses ``instructions`` + first input), or the first :data:`PROMPT_PREFIX_CHARS` characters
(tokens) of a completions prompt. None when the body names no conversation (then any replica).

Plan (:func:`plan_route`): the replica remembered for the key while it is still there; else
the key's rendezvous-hash choice (every router instance agrees without sharing memory, and
removing a replica moves only its own conversations); when the preferred replica has
``max_waiting`` or more requests in flight, the least-loaded replicas first. The plan lists
every replica, preferred first, so Ray Serve can fall through to the next when one is full.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import xxhash

from redlite.server.session_key import body_session_value, session_key_of, wire_of_path

PROMPT_PREFIX_CHARS = 256


@dataclass(frozen=True)
class ConversationKey:
    """A routing key and where it came from (``session``, ``prefix``)."""

    value: str
    source: str


def _text(content: Any) -> Any:
    """Message content as routed on: strings as they are, part lists as their text parts."""
    if isinstance(content, list):
        return [p.get("text") if isinstance(p, Mapping) else p for p in content]
    return content


def _stable_prefix(path: str, body: Mapping[str, Any]) -> Any:
    """System text and first user message of the body (None when it has no conversation)."""
    if path.startswith("/v1/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one
        return prompt[:PROMPT_PREFIX_CHARS] if isinstance(prompt, (str, list)) else None
    if path.startswith("/v1/responses"):
        items = body.get("input")
        if isinstance(items, list):
            items = next((i for i in items if isinstance(i, Mapping) and i.get("role") == "user"),
                         None)
            items = _text(items.get("content")) if items else None
        return [body.get("instructions"), items] if items is not None else None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    system = [_text(body.get("system"))] if "system" in body else []
    for message in messages:
        if not isinstance(message, Mapping):
            return None
        if message.get("role") in ("system", "developer"):
            system.append(_text(message.get("content")))
        elif message.get("role") == "user":
            return [system, _text(message.get("content"))]
    return None


def conversation_key(headers: Mapping[str, str], path: str,
                     body: Mapping[str, Any] | None) -> ConversationKey | None:
    """The routing key of a request (see the module docstring). ``headers`` lower-case names;
    ``body`` the parsed JSON object (None or not an object: session headers only)."""
    body = body if isinstance(body, Mapping) else {}
    session = session_key_of(headers, body_session_value(wire_of_path(path), body))
    if session is not None:
        return ConversationKey(session, "session")
    prefix = _stable_prefix(path, body)
    if prefix is None:
        return None
    digest = xxhash.xxh64(json.dumps(prefix, sort_keys=True, default=str).encode()).hexdigest()
    return ConversationKey(f"prefix:{digest}", "prefix")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it: its id and requests in flight (None: unknown)."""

    id: str
    in_flight: int | None = None


@dataclass(frozen=True)
class Route:
    """A plan: replica ids, preferred first (all of them), and why."""

    ranked: tuple[str, ...]
    reason: str

    @property
    def preferred(self) -> str | None:
        return self.ranked[0] if self.ranked else None


def rendezvous(key: str, replica_ids: Sequence[str]) -> str:
    """The replica with the highest hash of (key, replica id): stable for the key while that
    replica stays; a removed replica's keys spread over the others."""
    return max(replica_ids, key=lambda r: xxhash.xxh64(f"{key}\x00{r}".encode()).intdigest())


def _by_load(replicas: Sequence[ReplicaLoad]) -> list[str]:
    """Ids, least in flight first (unknown loads count as 0), ties by id."""
    return [r.id for r in sorted(replicas, key=lambda r: (r.in_flight or 0, r.id))]


def plan_route(key: str | None, replicas: Sequence[ReplicaLoad], remembered: str | None,
               max_waiting: int) -> Route:
    """Where a request with routing ``key`` goes (see the module docstring). remembered: the
    replica this key last went to (None: never, or forgotten); max_waiting: in-flight requests
    at which the preferred replica counts as overloaded (>= 1)."""
    if not replicas:
        return Route((), "no replicas")
    ids = [r.id for r in replicas]
    if key is None:
        return Route(tuple(_by_load(replicas)), "no conversation key: least loaded")
    if remembered in ids:
        preferred, reason = remembered, "remembered"
    else:
        preferred = rendezvous(key, ids)
        reason = "new: rendezvous hash" if remembered is None else \
            f"moved: replica {remembered} is gone, rendezvous hash"
    load = next(r.in_flight for r in replicas if r.id == preferred)
    others = [r for r in _by_load(replicas) if r != preferred]
    if load is not None and load >= max(1, max_waiting):
        return Route(tuple(others + [preferred]),
                     f"{reason}; {preferred} overloaded ({load} in flight): least loaded")
    return Route(tuple([preferred] + others), reason)


class AffinityTable:
    """Where each conversation went: routing key -> replica id, the ``capacity`` most recent
    (least recently routed forgotten first)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str | None) -> str | None:
        return None if key is None else self._where.get(key)

    def record(self, key: str | None, replica_id: str) -> None:
        if key is None:
            return
        self._where[key] = replica_id
        self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def __len__(self) -> int:
        return len(self._where)
