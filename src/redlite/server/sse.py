"""Response bodies: the OpenAI chat/text completion objects and their SSE stream.

A stream sends ``chat.completion.chunk`` (or ``text_completion``) objects as ``data:`` lines,
ends with a chunk carrying ``finish_reason``, then (with ``stream_options.include_usage``) a
chunk with ``usage`` and empty ``choices``, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from redlite.core.generation import GenerationResult
from redlite.core.worker import Event, Job
from redlite.server.errors import as_api_error, error_body


def finish_reason_of(result: GenerationResult) -> str:
    """OpenAI finish_reason: ``stop`` or ``length`` (a generation cut by a shutdown is reported
    as an error instead, see :func:`stream_events`)."""
    return "length" if result.finish_reason == "length" else "stop"


def usage_of(result: GenerationResult) -> dict:
    """The OpenAI ``usage`` object; ``prompt_tokens_details.cached_tokens`` = reused tokens."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def _envelope(meta: dict, chunk: bool) -> dict:
    if meta["chat"]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    return {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"]}


def completion_body(meta: dict, text: str, result: GenerationResult) -> dict:
    """The non-streamed OpenAI object (``chat.completion`` or ``text_completion``) for ``text``."""
    body = _envelope(meta, chunk=False)
    if meta["chat"]:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason_of(result)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason_of(result)}
    body["choices"] = [choice]
    body["usage"] = usage_of(result)
    return body


def _chunk(meta: dict, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
    body = _envelope(meta, chunk=True)
    if meta["chat"]:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    body["choices"] = [choice]
    return body


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


async def stream_events(events: asyncio.Queue[Event], job: Job, meta: dict,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """SSE bytes for one running job. When the client disconnects, the response task is
    cancelled or its send fails; ``finally`` then cancels the job so the worker stops at the
    next token."""
    try:
        if meta["chat"]:
            yield _sse(_chunk(meta, "", None, first=True))
        while True:
            event = await events.get()
            if event.kind == "output":
                yield _sse(_chunk(meta, event.value.value, None))
            elif event.kind == "done":
                result: GenerationResult = event.value
                if result.finish_reason == "cancelled":
                    # stopped by a shutdown while the client still reads: say the answer is cut
                    yield _sse(error_body(503, "server is shutting down; the answer was cut off",
                                          None, "shutting_down"))
                    break
                yield _sse(_chunk(meta, None if meta["chat"] else "", finish_reason_of(result)))
                if include_usage:
                    usage = _envelope(meta, chunk=True)
                    usage["choices"] = []
                    usage["usage"] = usage_of(result)
                    yield _sse(usage)
                break
            elif event.kind == "error":
                yield _sse(as_api_error(event.value).body())
                break
        yield b"data: [DONE]\n\n"
    finally:
        job.cancel()
