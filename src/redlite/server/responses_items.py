"""Input items of a stored response, for ``GET /v1/responses/{id}/input_items``.

:func:`input_items` renders a request's own ``input`` (not the ``previous_response_id`` chain
it continued) as the API lists it: each item gets an id once, when stored (``msg_`` for
messages, ``fc_`` for function calls, ``fco_`` for function call outputs, ``rs_`` for reasoning,
``item_`` otherwise; an id the client sent is kept) and a ``status`` of ``completed``. A string
input is one ``user`` message of one ``input_text`` part; message content given as a string
becomes one ``input_text`` (``output_text`` for ``assistant``) part. :func:`page` is OpenAI's
cursor pagination (``after`` / ``before`` item ids, ``limit`` 1..100 (default 20), ``order``
``asc`` | ``desc`` (default ``desc``)).
"""

from __future__ import annotations

from pydantic import BaseModel

from redlite.server.responses_events import item_id

_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
           "reasoning": "rs"}


def _message(item: dict) -> dict:
    content = item["content"]
    if isinstance(content, str):
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    if item["role"] == "assistant":
        content = [{**part, "annotations": part.get("annotations", [])}
                   if part["type"] == "output_text" else part for part in content]
    return {**item, "type": "message", "content": content}


def input_items(input_: str | list) -> list[dict]:
    """The listed form of a request's ``input`` (see module docstring), in input order."""
    if isinstance(input_, str):
        input_ = [{"type": "message", "role": "user", "content": input_}]
    items = []
    for raw in input_:
        item = raw.model_dump(exclude_none=True) if isinstance(raw, BaseModel) else dict(raw)
        if item.get("type", "message") == "message":
            item = _message(item)
        item.setdefault("status", "completed")
        prefix = _PREFIX.get(item["type"], "item")
        items.append({"id": item.pop("id", None) or item_id(prefix), **item})
    return items


def page(items: list[dict], after: str | None, before: str | None, limit: int,
         order: str) -> dict:
    """One page of ``items`` (stored in input order) as OpenAI's list object. ``after`` /
    ``before`` are exclusive cursors in the requested ``order`` (an unknown id cuts nothing);
    with ``before`` alone the page is the ``limit`` items nearest before it."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    stop = ids.index(before) if before in ids else len(ids)
    window = ordered[start:stop]
    data = window[-limit:] if before in ids and after is None else window[:limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(window) > limit}
