"""The legacy ``POST /v1/completions`` route: prompt -> generation job -> ``text_completion``.

Shapes (OpenAI API reference, legacy completions):

* non-streamed: ``choices = [{"index", "text", "logprobs", "finish_reason"}]`` for each of the
  ``n`` choices, ``usage`` with the prompt counted once and the completion tokens of every
  choice summed; ``prompt_tokens_details.cached_tokens`` is the first choice's reuse (later
  choices reuse the prompt the first one read).
* streamed: ``text_completion`` chunks ``{"choices": [{"index", "text", "logprobs",
  "finish_reason": null}]}``, choice after choice (they run one after another), each choice
  closed by a chunk with its ``finish_reason``; then the usage chunk (with
  ``stream_options.include_usage``) and ``data: [DONE]``. With ``logprobs`` each chunk carries
  the records of the tokens generated since the previous chunk
  (:func:`redlite.server.logprobs.completion_logprobs`).

The choices of one request run in one engine job: the prompt is read once, each later choice
rewinds to it (see :mod:`redlite.core.generation`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.core.worker import Event, Job
from redlite.server.access import request_id_of
from redlite.server.errors import APIError, as_api_error, error_body
from redlite.server.jobs import submit, watch_disconnect
from redlite.server.logprobs import TokenTexts, completion_logprobs


def finish_reason_of(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _text_of(event: Event) -> str:
    value = event.value
    return value if isinstance(value, str) else getattr(value, "value", "")


class _Choices:
    """Accumulates one job's events into per-choice text, records and results."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.index = 0
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.records: list[list] = [[] for _ in range(n)]
        self.results: list[GenerationResult] = []

    def usage(self) -> dict:
        first = self.results[0]
        completion = sum(r.completion_tokens for r in self.results)
        return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
                "total_tokens": first.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def _cut_off(result: GenerationResult) -> bool:
    return result.finish_reason == "cancelled"


async def collect(job: Job, events: asyncio.Queue, http_request: Any, meta: dict,
                  texts: TokenTexts | None) -> dict:
    """The non-streamed ``text_completion`` body."""
    n = meta["n"]
    choices = _Choices(n)
    watcher = asyncio.ensure_future(watch_disconnect(http_request, job))
    try:
        while len(choices.results) < n:
            event = await events.get()
            if event.kind in ("text", "output"):
                choices.texts[choices.index].append(_text_of(event))
            elif event.kind == "logprob":
                choices.records[choices.index].append(event.value)
            elif event.kind == "done":
                if _cut_off(event.value):
                    raise APIError(503, "server is shutting down; the answer was cut off",
                                   None, "shutting_down")
                choices.results.append(event.value)
                choices.index += 1
            elif event.kind == "error":
                raise as_api_error(event.value)
    finally:
        watcher.cancel()
        job.cancel()
    body = _envelope(meta)
    body["choices"] = [
        {"index": i, "text": "".join(choices.texts[i]),
         "logprobs": completion_logprobs(choices.records[i], texts) if texts is not None else None,
         "finish_reason": finish_reason_of(choices.results[i])} for i in range(n)]
    body["usage"] = choices.usage()
    return body


async def stream(job: Job, events: asyncio.Queue, meta: dict, texts: TokenTexts | None,
                 include_usage: bool) -> AsyncIterator[bytes]:
    """SSE bytes of a running completion job; a disconnect cancels it (``finally``). An error
    event carries ``meta["request_id"]`` (as the JSON errors do)."""
    n = meta["n"]
    choices = _Choices(n)
    offset = 0
    pending: list = []
    try:
        while len(choices.results) < n:
            event = await events.get()
            if event.kind in ("text", "output"):
                text = _text_of(event)
                logprobs = None
                if texts is not None:
                    logprobs = completion_logprobs(pending, texts, offset)
                    offset += sum(len(t) for t in logprobs["tokens"])
                    pending = []
                yield _sse(_chunk(meta, choices.index, text, logprobs, None))
            elif event.kind == "logprob":
                pending.append(event.value)
            elif event.kind == "done":
                result: GenerationResult = event.value
                if _cut_off(result):
                    yield _sse(error_body(503, "server is shutting down; the answer was cut off",
                                          None, "shutting_down", request_id=meta.get("request_id")))
                    break
                logprobs = completion_logprobs(pending, texts, offset) if texts is not None else None
                yield _sse(_chunk(meta, choices.index, "", logprobs, finish_reason_of(result)))
                choices.results.append(result)
                choices.index += 1
                offset, pending = 0, []
            elif event.kind == "error":
                yield _sse(as_api_error(event.value).body(request_id=meta.get("request_id")))
                break
        else:
            if include_usage:
                usage = _envelope(meta)
                usage["choices"] = []
                usage["usage"] = choices.usage()
                yield _sse(usage)
        yield b"data: [DONE]\n\n"
    finally:
        job.cancel()


def _envelope(meta: dict) -> dict:
    return {"id": meta["id"], "object": "text_completion", "created": meta["created"],
            "model": meta["model"]}


def _chunk(meta: dict, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
    body = _envelope(meta)
    body["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    return body


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


async def serve(state: Any, http_request: Any, body: Any, generation: GenerationRequest) -> Any:
    """Run ``generation`` (its ``n`` choices) and answer as the body asks (streamed or not)."""
    from fastapi.responses import StreamingResponse

    texts = None
    if generation.sampling.logprobs is not None:  # the first use builds the vocabulary view (~1 s)
        texts = await asyncio.to_thread(TokenTexts, state.tokenizer)
    job, events = await submit(state.worker, generation, http_request, state.retry_after_s)
    meta = {"id": generation.request_id, "created": int(time.time()), "model": state.model_id,
            "n": max(1, generation.n), "request_id": request_id_of(http_request.scope)}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(job, events, meta, texts, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await collect(job, events, http_request, meta, texts)
