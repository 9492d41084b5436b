"""The chat service every wire adapter calls: ChatRequest -> prompt -> engine worker -> events.

Adapters (chat completions, Anthropic Messages, Responses) build a
:class:`redlite.core.chat.ChatRequest` and call :meth:`ChatService.start`, which

1. renders the history through the model's chat template (tools and template kwargs passed;
   see :mod:`redlite.core.chat_render`), appending a forced call's opening for
   ``tool_choice: "required"`` / a named function (unless constrained decoding forces it);
2. chooses how the output is parsed (tool format and reasoning parser: the CLI's
   ``--tool-parser`` / ``--reasoning-parser``, else detected from the template; no tool parsing
   without tools or with ``tool_choice: "none"``);
3. submits a :class:`GenerationRequest` to the engine worker and waits until it starts.

The returned :class:`ChatStream` is an async iterator of :class:`OutputEvent` s; after it ends,
``stream.result`` holds the :class:`ChatResult` (parsed output + usage). Errors are
:class:`redlite.server.errors.APIError` (OpenAI-shaped; other adapters map status/message).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Sequence

from redlite.core.chat import ChatOutput, ChatRequest, OutputEvent
from redlite.core.constraints import ConstraintError, ConstraintSpec, build_constraint
from redlite.core.grammar import blame_tool, check_constraint
from redlite.core.chat_render import (detect_formats, render_request, template_renders_tools,
                                      tool_schemas)
from redlite.core.replay import REPLAY_MODES, ReplayStore
from redlite.core.replay_record import record_turn
from redlite.core.replay_splice import render_with_replay
from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.core.tokenizer import PromptTooLong, min_chat_tokens, no_prompt_limit
from redlite.core.output_scanner import REASONING_FORMATS, TOOL_FORMATS, ParseOptions
from redlite.core.worker import Event, Job
from redlite.server.errors import APIError, as_api_error, prompt_too_long
from redlite.server.access import context_of
from redlite.server.jobs import RETRY_AFTER_S, enqueue, in_thread, wait_started, watch_disconnect

log = logging.getLogger("redlite.chat")


@dataclass
class ChatOptions:
    """Server-wide chat settings (from the CLI). tool_parser / reasoning_parser: a name of
    :data:`TOOL_FORMATS` / :data:`REASONING_FORMATS`, or None to detect from the template."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    replay: str = "exact"
    replay_bytes: int = 64 << 20


@dataclass
class Usage:
    """Token counts of one answer. cached_tokens: prompt tokens reused from held state."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class ChatResult:
    """The end of a chat generation: the parsed output (finish_reason ``stop``, ``length``,
    ``tool_calls``), usage, and the engine's :class:`GenerationResult`."""

    output: ChatOutput
    usage: Usage
    generation: GenerationResult


@dataclass
class PreparedChat:
    """A rendered request, ready to submit (also what token counting needs)."""

    generation: GenerationRequest
    parse: ParseOptions
    prompt_text: str
    replayed: int = 0
    last_message: Any = None
    continued: bool = False  # the answer continues an assistant prefill (not kept for replay)


@dataclass
class QueuedChat:
    """A prepared chat request whose job is on the worker's queue: ``job`` and the asyncio
    queue of its events (:func:`redlite.server.jobs.enqueue`)."""

    prepared: PreparedChat
    job: Job
    events: asyncio.Queue


@dataclass
class ChoiceEnd:
    """Yielded by a :class:`ChatStream` of ``n`` > 1 choices after each choice but the last:
    the events that follow belong to choice ``index + 1``."""

    index: int
    result: ChatResult


class ChatStream:
    """A running chat generation. Iterate for :class:`OutputEvent` s; then read ``result``.
    ``cancel()`` stops the generation at the next token (call it when the client leaves).

    With ``n`` > 1 the choices come one after another, a :class:`ChoiceEnd` between two;
    ``results`` holds every choice's result, ``result`` the last one. With logprobs,
    ``logprobs[i]`` holds choice i's :class:`~redlite.engine.base.TokenLogprob` records and
    :meth:`take_logprobs` those not yet sent (for the next streamed chunk); ``token_texts``
    names the tokens (:class:`redlite.server.logprobs.TokenTexts`)."""

    def __init__(self, job: Job, events: asyncio.Queue, prepared: PreparedChat,
                 token_texts: Any = None, on_result: Any = None) -> None:
        self._on_result = on_result
        self._job = job
        self._events = events
        self.prepared = prepared
        self.request_id = prepared.generation.request_id
        self.prompt_tokens = len(prepared.generation.prompt_ids)
        self.created = int(time.time())
        self.result: ChatResult | None = None
        self.n = max(1, prepared.generation.n)
        self.index = 0
        self.results: list[ChatResult] = []
        self.logprobs: list[list] = [[] for _ in range(self.n)]
        self._pending: list = []
        self.token_texts = token_texts
        self._client_left = False

    def take_logprobs(self) -> list:
        """The logprob records that arrived since the last call."""
        taken, self._pending = self._pending, []
        return taken

    def cancel(self) -> None:
        """Stop the generation: the HTTP client has left (an answer it cuts is a 499, not the
        503 of a shutdown)."""
        self._client_left = True
        self._job.cancel()

    def __aiter__(self) -> AsyncIterator[OutputEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[OutputEvent | ChoiceEnd]:
        while len(self.results) < self.n:
            event: Event = await self._events.get()
            if event.kind == "output":
                yield event.value
            elif event.kind == "logprob":
                self.logprobs[self.index].append(event.value)
                self._pending.append(event.value)
            elif event.kind == "done":
                generation: GenerationResult = event.value
                if generation.finish_reason == "cancelled":
                    if self._client_left:
                        raise APIError(499, "client closed the request")
                    raise APIError(503, "server is shutting down; the answer was cut off",
                                   None, "shutting_down")
                self.result = ChatResult(generation.output, Usage(
                    generation.prompt_tokens, generation.completion_tokens,
                    generation.cached_tokens), generation)
                self.results.append(self.result)
                if self._on_result is not None:
                    self._on_result(self.prepared, self.result)
                if len(self.results) < self.n:
                    yield ChoiceEnd(self.index, self.result)
                    self.index += 1
            elif event.kind == "error":
                raise as_api_error(event.value)

    async def collect(self, http_request: Any = None) -> ChatResult:
        """Run to the end (non-streamed answer); cancel when the HTTP client disconnects."""
        watcher = asyncio.ensure_future(watch_disconnect(http_request, self)) if http_request else None
        try:
            async for _ in self:
                pass
        finally:
            if watcher is not None:
                watcher.cancel()
        return self.result




def _ends_of(rendered: Any) -> Sequence[int]:
    """A rendered prompt's message boundaries, computed when the worker first reads them (the
    first token waits for them only where checkpoints or a cache-miss line need them)."""
    deferred = getattr(rendered, "deferred_ends", None)
    return deferred() if deferred is not None else list(rendered.message_ends)


def _message_info(message: Any) -> tuple[str, str | None]:
    """(role, the tool-call id it carries or answers) of a history message."""
    if not isinstance(message, dict):
        return "", None
    calls = message.get("tool_calls") or []
    call_id = message.get("tool_call_id") or (calls[0].get("id") if calls and isinstance(calls[0], dict) else None)
    return str(message.get("role")), call_id


def render_error(request_id: str, error: Exception) -> APIError:
    """400 for a conversation the chat template refuses: the template's own message (jinja2's
    ``raise_exception``) is meant for the client; anything else only goes to the log."""
    if type(error).__module__.split(".")[0] == "jinja2":
        return APIError(400, f"cannot render the conversation: {error}", "messages")
    log.warning("%s cannot render the conversation: %s: %s", request_id, type(error).__name__, error)
    return APIError(400, "cannot render the conversation", "messages")


class ChatService:
    """Renders, submits and relays chat requests (see module docstring)."""

    def __init__(self, worker: Any, tokenizer: Any, max_context: int,
                 options: ChatOptions | None = None, retry_after_s: int = RETRY_AFTER_S) -> None:
        self.worker = worker
        self.retry_after_s = retry_after_s  # of a 503 "server busy"
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.options = options or ChatOptions()
        source = getattr(tokenizer, "chat_template_source", None)
        tool, reasoning = detect_formats(source if isinstance(source, str) else None)
        self.tool_format = self.options.tool_parser or tool
        reasoning = self.options.reasoning_parser or reasoning
        self.reasoning_format = None if reasoning in (None, "none") else reasoning
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"unknown tool parser {self.tool_format!r}; one of {TOOL_FORMATS}")
        if reasoning is not None and reasoning not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning parser {reasoning!r}; one of {REASONING_FORMATS}")
        if self.options.replay not in REPLAY_MODES:
            raise ValueError(f"unknown replay mode {self.options.replay!r}; one of {REPLAY_MODES}")
        self.replay = ReplayStore(self.options.replay_bytes) if self.options.replay == "exact" else None
        parking = getattr(getattr(worker, "generator", None), "parking", None)
        if self.replay is not None and parking is not None:  # turns saved with conversations
            parking.attach_replay(self.replay)
        log.info("chat formats: tool calls %s, reasoning %s; replay %s", self.tool_format,
                 self.reasoning_format or "none", self.options.replay)
        if not template_renders_tools(source if isinstance(source, str) else None):
            log.warning("the chat template does not render tools: requests' tool definitions "
                        "are not shown to the model (tool_choice 'required' or a named "
                        "function still forces a call)")

    def validate(self, request: ChatRequest) -> None:
        """400 for a tool_choice that cannot be honoured."""
        names = set(tool_schemas(request.tools))
        if request.tool_choice == "required" and not request.tools:
            raise APIError(400, "tool_choice forces a tool call, but the request has no tools", "tool_choice")
        if request.tool_choice not in ("auto", "none", "required") and request.tool_choice not in names:
            raise APIError(400, f"tool_choice names function {request.tool_choice!r}, which is not "
                           "in tools", "tool_choice")
        for name in request.allowed_tools or []:
            if name not in names:
                raise APIError(400, f"tool_choice allows function {name!r}, which is not in tools",
                               "tool_choice")

    def prepare_sync(self, request: ChatRequest, fit: bool = True) -> PreparedChat:
        """Render and build the GenerationRequest (blocking: call from a thread). ``fit``: a
        prompt longer than the context is a 400 ``context_length_exceeded`` (refused before
        rendering or tokenizing when a lower bound shows it); False for a token count, which
        answers any length and keeps every other check."""
        self.validate(request)
        # No lock: rendering and tokenizing are thread-safe and linear, so one long request never
        # holds up another's; a prompt that provably cannot fit is refused before the work
        # (rendering holds the GIL, so its cost is every concurrent request's delay).
        if fit:
            self._check_fits(min_chat_tokens(request.messages, self.tokenizer), at_least=True)
        head, prefill = request, ""
        if request.continue_final and request.messages:  # rendered up to the answer's start
            head = replace(request, messages=request.messages[:-1], continue_final=False)
            prefill = str(request.messages[-1].get("content") or "")
        try:
            with nullcontext() if fit else no_prompt_limit():
                rendered, replayed = render_with_replay(self.tokenizer, head, self.replay,
                                                        render_request)
        except PromptTooLong as error:
            raise prompt_too_long(error.at_least, error.limit, "messages", at_least=True) from None
        except Exception as error:  # a template that rejects the conversation
            raise render_error(request.request_id, error) from None
        parse_tools = bool(request.tools) and request.tool_choice != "none"
        fmt = self.tool_format if parse_tools else None
        text = rendered.text + prefill
        start_in_reasoning = bool(self.reasoning_format) and text.rstrip().endswith("<think>")
        constraint = self.constraint_of(request, fmt, start_in_reasoning)
        # shared with the render cache's prompt, not copied (nothing changes a prompt's ids in place)
        ids = rendered.token_ids if type(rendered.token_ids) is list else list(rendered.token_ids)
        if prefill:
            ids = ids + self.tokenizer.encode_text(prefill)
        parse = ParseOptions(
            tool_format=fmt, reasoning=self.reasoning_format,
            start_in_reasoning=start_in_reasoning, schemas=tool_schemas(request.tools),
            max_calls=None if request.parallel_tool_calls else 1, call_id_prefix=request.call_id_prefix)
        if not ids:
            raise APIError(400, "the prompt is empty", "messages")
        if fit:
            self._check_fits(len(ids))
        sampling = replace(request.sampling, constraint=constraint,
                           logprobs=request.logprobs if request.logprobs is not None
                           else request.sampling.logprobs)
        generation = GenerationRequest(ids, request.max_tokens, sampling, list(request.stop),
                                       _ends_of(rendered), request.request_id, parse=parse,
                                       n=max(1, request.n), session_key=request.session_key,
                                       message_info=[_message_info(m) for m in head.messages])
        if replayed:  # logged by the engine thread with its own lines, past the first token
            generation.notes.append((log, f"replay: {replayed} generated turn{'s' * (replayed != 1)} spliced"
                                          + (f" session={request.session_key}" if request.session_key else "")))
        return PreparedChat(generation, parse, text, replayed,
                            request.messages[-1] if request.messages else None, bool(prefill))

    def _check_fits(self, tokens: int, at_least: bool = False) -> None:
        """The context rule of chat prompts: 400 for ``tokens`` (a lower bound when
        ``at_least``) past ``max_context``."""
        if tokens > self.max_context:
            raise prompt_too_long(tokens, self.max_context, "messages", at_least=at_least)

    def _record(self, prepared: PreparedChat, result: ChatResult) -> None:
        if self.replay is not None and not prepared.continued:
            record_turn(self.replay, self.tokenizer, prepared.generation, result.generation,
                        prepared.last_message)

    def constraint_of(self, request: ChatRequest, tool_format: str | None,
                      start_in_reasoning: bool) -> ConstraintSpec | None:
        """The output grammar (:func:`redlite.core.constraints.build_constraint`): forced calls
        for ``required`` / a named function, a lazy call grammar for ``auto`` with tools, the
        ``response_format`` JSON; reasoning may come first when the model reasons (unless
        ``enable_thinking`` is false). 400 naming the field when it cannot be built (an invalid
        schema, say), except for the ``auto`` call grammar, which is then left out (logged)."""
        thinking = bool(self.reasoning_format) and request.template_kwargs.get("enable_thinking") is not False
        reasoning = "open" if start_in_reasoning else "optional" if thinking else "none"
        try:
            callable_tools = request.tools if request.allowed_tools is None else [
                tool for tool in request.tools if tool["function"]["name"] in request.allowed_tools]
            spec = build_constraint(request.response_format, callable_tools if tool_format else [],
                                    request.tool_choice, tool_format,
                                    parallel_tool_calls=request.parallel_tool_calls,
                                    reasoning=reasoning)
            if spec is not None:
                check_constraint(spec, self.tokenizer)
        except ConstraintError as error:
            if request.tool_choice == "auto" and not request.response_format:
                # only the optional call grammar failed: answer unconstrained rather than refuse
                log.warning("%s tool-call grammar not usable, calls unconstrained: %s",
                            request.request_id, error)
                return None
            if error.param == "tools" and request.tools:
                error = blame_tool(error, request.tools, tool_format, self.tokenizer)
            raise APIError(400, str(error), error.param) from None
        return spec

    async def prepare(self, request: ChatRequest, fit: bool = True) -> PreparedChat:
        return await asyncio.to_thread(self.prepare_sync, request, fit)

    def enqueue_sync(self, request: ChatRequest, prepared: PreparedChat, loop: asyncio.AbstractEventLoop,
                     http_request: Any = None) -> QueuedChat:
        """Queue ``prepared`` (:meth:`prepare_sync` of ``request``) on the worker, from the
        thread that prepared it (:func:`redlite.server.jobs.enqueue`; ``loop``: the server's
        event loop). Raises APIError 503 (queue full, shutting down)."""
        scope = getattr(http_request, "scope", None)
        if scope is not None:
            context_of(scope).session_key = request.session_key  # for the access log
        job, events = enqueue(self.worker, prepared.generation, loop, scope, self.retry_after_s)
        return QueuedChat(prepared, job, events)

    async def start(self, request: ChatRequest, http_request: Any = None,
                    queued: QueuedChat | None = None) -> ChatStream:
        """Render and queue ``request`` in one thread hand-off (unless ``queued``: the caller's
        :meth:`prepare_sync` and :meth:`enqueue_sync` of it), then wait for the job to start.
        Raises APIError (400 bad request, 503 busy / shutting down, 499 when the HTTP client
        left while the job waited)."""
        if queued is None:
            loop = asyncio.get_running_loop()
            queued = await in_thread(
                lambda: self.enqueue_sync(request, self.prepare_sync(request), loop, http_request),
                lambda done: done.job)
        await wait_started(queued.job, queued.events, http_request)
        texts = None
        if queued.prepared.generation.sampling.logprobs is not None:  # the first use takes ~1 s
            from redlite.server.logprobs import TokenTexts

            texts = await asyncio.to_thread(TokenTexts, self.tokenizer)
        return ChatStream(queued.job, queued.events, queued.prepared, texts, self._record)
