"""Small pieces shared by the Anthropic Messages and OpenAI Responses adapters.

* :class:`Usage`: the token counts of one finished generation, in redlite's own terms.
* :func:`sse_event`: one named server-sent event (``event: TYPE`` + ``data: JSON``), the framing
  both APIs use.
* :func:`arguments_object`: a tool call's JSON argument text as an object.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

log = logging.getLogger("redlite.server")


@dataclass
class Usage:
    """prompt_tokens: the whole rendered prompt; cached_tokens: how many of them were reused
    from held or parked state (not prefilled again); completion_tokens: generated tokens;
    reasoning_tokens: how many of those were reasoning (0 when unknown)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


def sse_event(event: dict) -> bytes:
    """``event: <event["type"]>\\ndata: <json>\\n\\n`` as UTF-8 bytes."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode("utf-8")


def arguments_object(arguments: str) -> dict:
    """The parsed arguments of a call; an empty text is ``{}``. The parser only reports complete
    calls with JSON-object arguments, so anything else is logged and given back as ``{}``."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        log.warning("tool call arguments are not valid JSON: %.200r", arguments)
        return {}
    if not isinstance(value, dict):
        log.warning("tool call arguments are not a JSON object: %.200r", arguments)
        return {}
    return value
