"""Which error of a request body's validation to report, and the request field it names
(pure): the server's 400 for an invalid body (``redlite.server.app``) says the offending field
as the client wrote it, whatever union members and tags pydantic tried on the way."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError


def param_of(loc: tuple, body: Any = None) -> str | None:
    """The dotted request field of a pydantic error location (``messages.0.content.1``,
    ``stop.0``): union member tags that pydantic puts in ``loc`` (``str``, ``list[int]``,
    ``constrained-str``, model class names) are dropped; field names are snake_case
    identifiers or list indices. With the parsed ``body``, a part that is no key or index of
    the body there is a tag too (a discriminator's value: Anthropic's ``user`` of
    ``messages.0.user.content``), but for the last one (a missing field)."""
    parts = [p for p in loc if p != "body"]
    if body is not None:
        kept, node = [], body
        for i, part in enumerate(parts):
            if isinstance(node, dict) and part in node or \
                    isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                kept.append(part)
                node = node[part]
            elif i == len(parts) - 1:
                kept.append(part)
        parts = kept
    parts = [str(p) for p in parts]
    parts = [p for p in parts if not ("[" in p or "-" in p or p[:1].isupper()
                                      or p in _TYPE_TAGS)]
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def loads_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def first_error(error: ValidationError) -> dict:
    """The error to report: an unsupported content part first, else the deepest location
    (the union member that got furthest, e.g. the token-id list for ``"prompt": [true]``);
    at equal depth, a member whose type matched (``"stop"``: five strings is "at most 4
    items", not "a valid string"); members whose ``type`` tag differs from the item's are
    left out (a ``function_call`` item without ``call_id`` is "call_id: Field required")."""
    errors = error.errors()
    for item in errors:
        if item["type"] == "unsupported_content":
            return item
    wrong = {tuple(e["loc"][:-1]) for e in errors  # members whose "type" tag did not match
             if e["type"] == "literal_error" and e["loc"] and e["loc"][-1] == "type"}
    kept = [e for e in errors if not any(tuple(e["loc"][:len(w)]) == w for w in wrong)]
    kept += _unmatched_tags(errors, wrong, kept)
    return max(kept or errors, key=lambda item: (len(item.get("loc", ())),
                                                 not item["type"].endswith("_type")))


def _unmatched_tags(errors: list[dict], wrong: set, kept: list[dict]) -> list[dict]:
    """An error at the ``type`` of each list item no union member took (every member's tag
    differs: a block type the server does not take), naming the tag and the expected ones."""
    found = []
    items = {w if isinstance(w[-1], int) else w[:-1] for w in wrong if w}  # a member or the item
    for item in {i for i in items if i and isinstance(i[-1], int)}:
        if any(tuple(e["loc"][:len(item)]) == item for e in kept):
            continue
        tags = [e for e in errors if e["type"] == "literal_error" and e["loc"][-1] == "type"
                and len(item) < len(e["loc"]) <= len(item) + 2 and tuple(e["loc"][:len(item)]) == item]
        expected = ", ".join(e["ctx"]["expected"] for e in tags)
        found.append({"loc": item + ("type",), "type": "union_tag_invalid", "msg": f"Input tag "
                      f"{tags[0]['input']!r} found using 'type' does not match any of the "
                      f"expected tags: {expected}"})
    return found
