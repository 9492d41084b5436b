"""``reasoning.encrypted_content`` of the Responses API: an opaque, self-contained string that
carries a reasoning text from one request to a later one (clients that send ``store: false``,
as Codex does, replay it instead of a stored response id).

Format: ``"rlr1." + base64url(JSON {"reasoning": text})`` without padding. It is an encoding,
not encryption and not signed: the text is the model's own output that the client already
received, the string stays valid across server restarts, and a client that edits it only
changes its own prompt (exactly as editing a replayed ``reasoning_text`` part would). A replayed
value with the prefix that does not decode is a 400; one without it is another server's and is
ignored (:mod:`redlite.server.responses_schemas`, :mod:`redlite.server.responses_convert`).
"""

from __future__ import annotations

import base64
import binascii
import json

PREFIX = "rlr1."


def encode_reasoning(text: str) -> str:
    """The opaque string for ``text``."""
    raw = json.dumps({"reasoning": text}, ensure_ascii=False).encode("utf-8")
    return PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_reasoning(token: str) -> str | None:
    """The reasoning text inside ``token``; None when it is not one of ours (another server's
    encrypted content) or is damaged."""
    if not token.startswith(PREFIX):
        return None
    body = token[len(PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        value = json.loads(raw.decode("utf-8"))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    text = value.get("reasoning") if isinstance(value, dict) else None
    return text if isinstance(text, str) else None
