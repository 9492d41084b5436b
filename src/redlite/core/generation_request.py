"""The requests the :class:`~redlite.core.generation.Generator` runs and what they give back:
:class:`GenerationRequest` (one chat request, tokenized), :class:`EngineTask` (work on a slot's
engine run in the request queue), :class:`GenerationResult` (one choice's answer and counts) and
:class:`GeneratorSettings` (the CLI's reuse, checkpoint and prefill options)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from redlite.core.chat import ChatOutput
from redlite.core.output_scanner import ParseOptions
from redlite.engine.base import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from redlite.core.generation import Generator
    from redlite.core.reuse import ReusePlan


@dataclass
class GenerationRequest:
    """One request as the engine worker sees it.

    prompt_ids: the full prompt (len >= 1, <= the engine's max_context; never changed in place:
    it may be a rendered prompt's own list, shared with the render cache). message_ends: message
    boundary positions (tokens) of a chat prompt, for checkpoints, the answer's start and the
    cache-miss line; read-only, possibly a :class:`~redlite.core.tokenizer.LazyPositions`
    computed on first read (replaced, never changed in place). max_tokens: the most tokens to
    generate (None: until end of turn or a full context). stop: validated stop strings.
    parse: how the output is split into content / reasoning / tool calls (None: all content).
    n: how many answers (choices) to generate for the prompt, one after another.
    session_key: the client's session key (names the conversation when parked; in log lines).
    message_info: (role, first tool-call id or None) per chat message, for the cache-miss line.
    reused: set by the engine thread once the first choice's reuse plan is made, before its
    prefill runs: the prompt tokens taken from held state (None until then; for usage reports
    sent before the answer, as Anthropic's ``message_start``).
    launched: called on the engine thread once a choice's plan is made, before its prefill; for
    an engine that launches asynchronously and a prefill of 1 to ``generation.SHORT_PREFILL``
    tokens, once that prefill is queued instead. The worker's ``started`` event (None: not
    called); the HTTP side's work on it (the response's start) then runs while the device
    computes, not contending for the GIL with selection and launch.
    notes: ``(logger, text)`` lines about the request (a replay splice, a restored
    conversation) that the engine thread logs after the request id when it writes the
    cache-miss line (:meth:`log_notes`): after the first token, or before a long prefill.
    Writing a log line is host time the TTFT need not wait for.
    """

    prompt_ids: list[int]
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    message_ends: Sequence[int] = field(default_factory=list)
    request_id: str = "req"
    cancelled: threading.Event = field(default_factory=threading.Event)
    parse: ParseOptions | None = None
    n: int = 1
    session_key: str | None = None
    message_info: list[tuple[str, str | None]] = field(default_factory=list)
    reused: int | None = None
    launched: Callable[[], None] | None = None
    notes: list[tuple[logging.Logger, str]] = field(default_factory=list)

    def log_notes(self) -> None:
        """Log and forget the :attr:`notes` (at INFO, each after the request id)."""
        notes, self.notes = self.notes, []
        for logger, text in notes:
            logger.info("%s %s", self.request_id, text)


@dataclass
class EngineTask(GenerationRequest):
    """A job that is not a generation (the slot API's save/restore/erase): queued like a request,
    ``action(generator)`` runs on the engine worker thread between generations. Its return
    value lands in ``result``, an exception in ``error``; ``prompt_ids`` is unused."""

    action: Callable[["Generator"], Any] | None = None
    slot: int = 0  # the sequence slot whose generator runs it (``--parallel``)
    result: Any = None
    error: BaseException | None = None


@dataclass
class GenerationResult:
    """The end of a generation (of one choice). finish_reason: ``stop`` (end of turn or a stop
    sequence), ``length`` (max_tokens or a full context) or ``cancelled`` (client gone,
    shutdown). output: the parsed answer (its finish_reason may be ``tool_calls``).
    index: the choice (0-based; the request's last choice is ``n - 1``).
    logprobs: with ``SamplingParams.logprobs`` set, one record per generated token (the
    end-of-turn token excluded), else None. answer_ids: the generated token ids (the
    end-of-turn token excluded; for exact replay, :mod:`redlite.core.replay`).
    prefilled_tokens: prompt tokens read by this request (``prompt_tokens - cached_tokens``,
    the default; fewer for a prefill cancelled part-way, which also has no first token)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float
    plan: ReusePlan
    output: ChatOutput = field(default_factory=ChatOutput)
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    answer_ids: list[int] = field(default_factory=list)
    prefilled_tokens: int = -1

    def __post_init__(self) -> None:
        if self.prefilled_tokens < 0:
            self.prefilled_tokens = self.prompt_tokens - self.cached_tokens

    @property
    def prefill_complete(self) -> bool:
        """Whether the whole prompt was read (a first token could follow)."""
        return self.cached_tokens + self.prefilled_tokens >= self.prompt_tokens


@dataclass
class GeneratorSettings:
    """reuse: False for ``--no-reuse``. checkpoint_interval: tokens between checkpoints inside
    long prefills (``--checkpoint-interval``). checkpoint_bytes: ``--checkpoint-mib`` in bytes;
    0 disables checkpoints (an engine that cannot rewind then resets on every fork).
    prefill_chunk: most tokens per ``engine.prefill`` call (``--prefill-chunk``); between chunks a
    cancelled request (client gone, shutdown) stops, keeping what was prefilled.
    max_tokens: server-side cap on generated tokens for every request (``--max-tokens``; None:
    no cap). same_bytes: keep held ids where a prompt re-tokenizes bytes the state holds
    (:mod:`redlite.core.same_bytes`; ``--replay exact``, with a tokenizer that has
    ``token_bytes``). checkpoint_min_piece: the fewest tokens between two checkpoint cuts of
    one prefill (``--checkpoint-min-piece``; see :func:`prefill_split_points`); None: the
    engine's ``checkpoint_min_piece`` (0 where it has none: a cut at every boundary)."""

    reuse: bool = True
    checkpoint_interval: int = 1024
    checkpoint_min_piece: int | None = None
    checkpoint_bytes: int = 512 << 20
    prefill_chunk: int = 512
    max_tokens: int | None = None
    same_bytes: bool = True
