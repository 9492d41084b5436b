"""The client's session identity, from the headers and body fields agents send (torch-free).

Headers, first found wins: ``X-Claude-Code-Session-Id`` (Claude Code), ``session_id`` /
``session-id`` (Codex, Qwen Code), ``x-session-affinity`` (routers); then the body's own field
(:func:`body_session_value`: ``prompt_cache_key`` on OpenAI bodies, Anthropic
``metadata.user_id``). It names the
conversation: its parked entry is the first candidate for its next request
(:mod:`redlite.core.conversations`), replicas route on it (:mod:`redlite.cluster.affinity`),
and it appears in the log lines. None when absent.
"""

from __future__ import annotations

from typing import Any, Mapping

SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "session-id", "x-session-affinity")
_MAX_CHARS = 256


def session_key_of(headers: Mapping[str, str], body_value: Any = None) -> str | None:
    """The session key (at most 256 characters kept), or None."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return str(value)[:_MAX_CHARS]
    if isinstance(body_value, str) and body_value:
        return body_value[:_MAX_CHARS]
    return None


def body_session_value(wire: str, body: Mapping[str, Any]) -> Any:
    """The body field that names the session on ``wire`` (``"anthropic"``: ``metadata.user_id``;
    ``"openai"``, chat, completions and responses: ``prompt_cache_key``); None when absent.
    ``body`` is the JSON object as a mapping (not validated)."""
    if wire == "anthropic":
        metadata = body.get("metadata")
        return metadata.get("user_id") if isinstance(metadata, Mapping) else None
    return body.get("prompt_cache_key")


def wire_of_path(path: str) -> str:
    """``"anthropic"`` for ``/v1/messages`` routes, else ``"openai"``."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"
