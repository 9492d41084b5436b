"""The OpenAI chat-completions adapter: request body -> ChatRequest, OutputEvents -> response.

Shapes follow the OpenAI API reference (chat completions):

* non-streamed: ``choices[0].message`` = ``{"role": "assistant", "content", "tool_calls": [{"id":
  "call_…", "type": "function", "function": {"name", "arguments": JSON text}}],
  "reasoning_content", "reasoning"}`` (``content`` null when the answer is only calls; reasoning
  in both names, as clients read either), ``finish_reason`` ``stop`` / ``length`` /
  ``tool_calls``;
* streamed: ``chat.completion.chunk`` objects: a first delta with the role, then ``content``,
  ``reasoning_content`` + ``reasoning``, or ``tool_calls: [{"index", "id", "type", "function":
  {"name", "arguments": ""}}]`` (a call's start, name first) and ``tool_calls: [{"index",
  "function": {"arguments": piece}}]`` as the arguments are generated; a last chunk with
  ``finish_reason``; with ``stream_options.include_usage`` a usage chunk; ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from redlite.core.chat import ChatRequest, OutputEvent
from redlite.engine.base import SamplingParams
from redlite.server.chat_service import ChatResult, ChatStream, ChoiceEnd, Usage
from redlite.server.logprobs import chat_logprobs, choices_usage
from redlite.server.errors import APIError, as_api_error
from redlite.server.schemas import ChatCompletionRequest


def chat_request_of(body: ChatCompletionRequest, sampling: SamplingParams, stop: list[str],
                    request_id: str) -> ChatRequest:
    """The internal request for a validated chat-completions body."""
    messages = []
    for m in body.messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": None if m.content is None else m.text()}
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id or f"call_{i}", "type": "function",
                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for i, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id or ""
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        tool_choice = "auto"
    elif isinstance(choice, str):
        tool_choice = choice
    else:
        tool_choice = choice.function.name
    kwargs = dict(body.chat_template_kwargs or {})
    if body.enable_thinking is not None:
        kwargs.setdefault("enable_thinking", body.enable_thinking)
    if body.response_format is not None and body.response_format.get("type") not in (None, "text"):
        response_format = body.response_format
    else:
        response_format = None
    return ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice,
                       parallel_tool_calls=body.parallel_tool_calls is not False,
                       template_kwargs=kwargs,
                       max_tokens=body.max_completion_tokens or body.max_tokens,
                       sampling=sampling, stop=stop, response_format=response_format,
                       logprobs=sampling.logprobs, n=body.n or 1, request_id=request_id)


def usage_of(usage: Usage) -> dict:
    """The OpenAI ``usage`` object; ``prompt_tokens_details.cached_tokens`` = reused tokens."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _envelope(stream: ChatStream, model: str, kind: str) -> dict:
    return {"id": stream.request_id, "object": kind, "created": stream.created, "model": model}


def completion_body(stream: ChatStream, model: str, result: ChatResult) -> dict:
    """The ``chat.completion`` object (``choices``: one per result of ``stream``, usage summed
    over them; see :func:`redlite.server.logprobs.choices_usage`)."""
    results = stream.results or [result]
    body = _envelope(stream, model, "chat.completion")
    body["choices"] = [_choice(stream, i, r) for i, r in enumerate(results)]
    body["usage"] = usage_of(choices_usage([r.usage for r in results]))
    return body


def _choice(stream: ChatStream, index: int, result: ChatResult) -> dict:
    out = result.output
    message: dict[str, Any] = {"role": "assistant",
                               "content": out.content if out.content or not out.tool_calls else None}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
        message["reasoning"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in out.tool_calls]
    logprobs = None
    if stream.token_texts is not None:
        logprobs = chat_logprobs(stream.logprobs[index], stream.token_texts)
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": out.finish_reason}


def delta_of(event: OutputEvent) -> dict:
    """The chunk ``delta`` for one output event."""
    if event.kind == "content":
        return {"content": event.value}
    if event.kind == "reasoning":
        return {"reasoning_content": event.value, "reasoning": event.value}
    piece = event.value
    if piece.name is not None:
        call = {"index": piece.index, "id": piece.id, "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments}}
    else:
        call = {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"tool_calls": [call]}


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


async def stream_chunks(stream: ChatStream, model: str, include_usage: bool,
                        request_id: str | None = None) -> AsyncIterator[bytes]:
    """SSE bytes of one running chat stream; a disconnect cancels the generation. An error
    mid-stream is an ``{"error": {...}}`` event carrying ``request_id`` (as the JSON errors
    do), then ``data: [DONE]``."""

    def chunk(delta: dict, finish: str | None = None, index: int | None = None) -> bytes:
        body = _envelope(stream, model, "chat.completion.chunk")
        logprobs = None
        if stream.token_texts is not None:
            logprobs = chat_logprobs(stream.take_logprobs(), stream.token_texts)
        body["choices"] = [{"index": stream.index if index is None else index, "delta": delta,
                            "logprobs": logprobs, "finish_reason": finish}]
        return _sse(body)

    try:
        yield chunk({"role": "assistant", "content": ""})
        try:
            async for event in stream:
                if isinstance(event, ChoiceEnd):  # n > 1: close this choice, open the next
                    yield chunk({}, event.result.output.finish_reason, event.index)
                    yield chunk({"role": "assistant", "content": ""}, None, event.index + 1)
                    continue
                yield chunk(delta_of(event))
        except APIError as error:
            yield _sse(error.body(request_id=request_id))
            yield b"data: [DONE]\n\n"
            return
        except Exception as error:  # noqa: BLE001 - the stream reports it in its own shape
            yield _sse(as_api_error(error).body(request_id=request_id))
            yield b"data: [DONE]\n\n"
            return
        result = stream.result
        yield chunk({}, result.output.finish_reason)
        if include_usage:
            body = _envelope(stream, model, "chat.completion.chunk")
            body["choices"] = []
            body["usage"] = usage_of(choices_usage([r.usage for r in stream.results or [result]]))
            yield _sse(body)
        yield b"data: [DONE]\n\n"
    finally:
        stream.cancel()
