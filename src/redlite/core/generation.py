"""Runs one request on the engine: plan reuse, execute the plan, generate, keep the held ids.

The :class:`Generator` owns the held conversation: the token ids the engine state holds (the
prompt of the last request plus every generated token that was fed back into the model). A
token is fed back only when another one is decoded after it, so the end-of-turn token, the token
that hit ``max_tokens`` and the token that completed a stop sequence are not held. The held ids
and the engine agree at every moment; when a request fails mid-way the history is marked
untrusted and the next request resets.

Tokens come from the engine's token stream when it samples the request itself (on the device,
one token ahead of the host: the step that feeds token n runs while the host reads,
detokenizes and scans it; a token that ends the answer is taken back, see
:mod:`redlite.core.token_loop`), else from a host sampler over each step's logits.

A request with ``n`` > 1 runs its choices one after another: each later choice plans against
the held state of the previous one (prompt + its answer), so the planner rewinds (or restores
the checkpoint at the prompt's end) and only the answer is recomputed; later choices skip the
parking step, since the previous choice's answer is not worth keeping. With a seed, choice i
samples with ``seed + i``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

from redlite.core.checkpoints import CheckpointStore, preamble_end, prefill_split_points
from redlite.core.divergence import SHOWN_TOKENS, describe_divergence, describe_message
from redlite.core.generation_request import EngineTask, GenerationRequest, GenerationResult, GeneratorSettings
from redlite.core.reuse import Action, MissReason, ReusePlan, common_prefix_length, plan_reuse
from redlite.core.same_bytes import adopt_held_spelling
from redlite.core.chat import OutputEvent
from redlite.core.output_scanner import OutputScanner
from redlite.core.sequence import Sequence
from redlite.core.token_loop import HostLoop, StreamLoop
from redlite.core.tokenizer import Tokenizer
from redlite.engine.base import Engine, EngineError, TokenLogprob

log = logging.getLogger("redlite.generation")

#: an engine that launches asynchronously (``Engine.launches_async``) queues prefills of 1 to
#: this many tokens before ``GenerationRequest.launched`` is called (the response's start then
#: overlaps the device's work, not selection and launch); longer ones, any prefill of a host
#: engine and a plan with nothing to prefill (a checkpoint at the prompt's end) run after it
SHORT_PREFILL = 64


def _field(name: str) -> property:
    """A Generator attribute that is its :class:`Sequence`'s field ``name``."""
    return property(lambda self: getattr(self.sequence, name),
                    lambda self, value: setattr(self.sequence, name, value))


class Generator:
    """Executes requests one at a time on one engine slot, whose conversation is
    ``self.sequence`` (called from the thread serving that slot)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, settings: GeneratorSettings | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.tokenizer = tokenizer
        self.settings = settings or GeneratorSettings()
        self.sequence = Sequence(engine, CheckpointStore(self.settings.checkpoint_bytes))
        self._clock = clock
        # Candidate selection among the live and parked conversations (redlite.core.conversations
        # .Conversations); None: the live state is the only candidate.
        self.parking = None
        self._common: tuple | None = None  # (held list, its length, prompt list, its length, common)

    # the held conversation's fields, owned by its Sequence (one place for each)
    engine = _field("engine")
    held_ids = _field("held_ids")
    checkpoints = _field("checkpoints")
    failed = _field("failed")
    session_key = _field("session_key")
    hits = _field("hits")  # requests whose first choice reused the state (0: a new one)
    _answer_start = _field("answer_start")  # where the last answer starts in held_ids

    # --- planning and executing --------------------------------------------------------------

    def plan(self, prompt_ids: list[int]) -> ReusePlan:
        """The reuse plan for ``prompt_ids`` against the held state (pure, no side effects).
        Held ids that disagree with the engine's ``n_past`` (a failure mid-way) count as a
        failure: the plan resets with ``reason=after-failure``."""
        consistent = len(self.held_ids) == self.engine.n_past
        if not consistent and not self.failed:
            log.warning("held %d tok but the engine holds %d: resetting", len(self.held_ids),
                        self.engine.n_past)
        token_bytes = getattr(self.tokenizer, "token_bytes", None) if self.settings.same_bytes else None
        after_failure = self.failed or not consistent
        known = self.common_with(prompt_ids) if self.settings.reuse and not after_failure else None
        return plan_reuse(self.held_ids, prompt_ids, self.engine.can_rewind,
                          self.checkpoints.positions, enabled=self.settings.reuse,
                          after_failure=after_failure, token_bytes=token_bytes, common=known)

    def common_with(self, prompt_ids: list[int]) -> int:
        """The length of the common prefix of the held ids and ``prompt_ids``, computed once
        while the request plans and selects (the same two lists, neither replaced nor resized;
        forgotten when the request executes)."""
        held, memo = self.held_ids, self._common
        if memo is not None and memo[0] is held and memo[1] == len(held) \
                and memo[2] is prompt_ids and memo[3] == len(prompt_ids):
            return memo[4]
        known = self.sequence.known_common(prompt_ids)  # the same prompt list again: held already
        return self.know_common(prompt_ids, common_prefix_length(held, prompt_ids, start=known))

    def know_common(self, prompt_ids: list[int], common: int) -> int:
        """Remember ``common``, the caller's common prefix of the held ids and ``prompt_ids``
        (a conversation just installed, compared as a candidate), for :meth:`common_with`."""
        self._common = (self.held_ids, len(self.held_ids), prompt_ids, len(prompt_ids), common)
        return common

    def _execute(self, plan: ReusePlan, request: GenerationRequest) -> tuple[Any, bool]:
        """Bring the engine to the prompt's end; return ``(logits there, True)``, or
        ``(None, False)`` when the request was cancelled between two prefill chunks (what was
        prefilled stays held). ``failed`` is set while the engine may be ahead of the held ids."""
        engine, prompt = self.engine, request.prompt_ids
        logits = None
        self._common = None  # the held ids change from here on
        if self.parking is not None and plan.keep < len(self.held_ids):
            self.parking.before_cut(self, plan.keep)  # parked tails on the cut part: made whole
        self.failed = True
        if plan.action is Action.RESET:
            engine.reset()
            self.held_ids = []
            self.checkpoints.clear()
        elif plan.action is Action.REWIND:
            engine.rewind(plan.keep)
            self.sequence.cut(plan.keep)
            self.checkpoints.drop_after(plan.keep)
        elif plan.action is Action.RESTORE:
            checkpoint = self.checkpoints.get(plan.checkpoint_position)
            logits = engine.restore_checkpoint(checkpoint)
            self.sequence.cut(plan.keep)
            self.checkpoints.drop_after(plan.keep)
        if self._answer_start is not None and plan.keep < self._answer_start:
            self._answer_start = None  # the cut dropped the last answer (a cancelled prefill keeps none)
        self.failed = False
        if plan.keep == len(prompt):
            self.sequence.note_prompt(prompt)
            return logits, True
        checkpointing = not engine.can_rewind and self.settings.checkpoint_bytes > 0
        preamble = self._preamble(plan, request) if checkpointing else None
        if not checkpointing:
            ends = [len(prompt)]
        else:  # checkpoints on message boundaries, every checkpoint_interval tokens, at the end
            ends = prefill_split_points(plan.keep, len(prompt), request.message_ends,
                                        self.settings.checkpoint_interval, self._min_piece(),
                                        preamble)
        if preamble is not None and preamble <= plan.keep:  # kept (e.g. a restored conversation)
            self.checkpoints.pin(preamble)
        start = plan.keep
        for end in ends:
            while start < end:
                if request.cancelled.is_set():
                    log.info("%s prefill stopped at %d of %d tok: cancelled", request.request_id,
                             start, len(prompt))
                    return None, False
                stop = min(end, start + max(1, self.settings.prefill_chunk))
                self.failed = True
                logits = engine.prefill(prompt[start:stop])
                self.held_ids.extend(prompt[start:stop])
                self.failed = False
                start = stop
            if checkpointing:
                checkpoint = engine.take_checkpoint(logits, turn_boundary=end == len(prompt))
                if checkpoint is not None:
                    self.checkpoints.add(checkpoint, pinned=end == preamble)
        if len(ends) > 1 or not engine.can_rewind:
            log.info("checkpoints: %d (%d bytes)", len(self.checkpoints), self.checkpoints.nbytes)
        self.sequence.note_prompt(prompt)
        return logits, True

    def _preamble(self, plan: ReusePlan, request: GenerationRequest) -> int | None:
        """Where the prompt's leading system messages end (:func:`preamble_end`). For a prefill
        too short to be cut (under twice the minimum piece), the held conversation's pinned
        preamble when it lies in the kept prefix, so a second turn does not wait for the
        message boundaries: the prompt shares those tokens, so its system messages end there
        too. A template could defeat that guess; it places a checkpoint, never a token."""
        pinned, min_piece = self.checkpoints.pinned, self._min_piece()
        if pinned is not None and pinned <= plan.keep and min_piece > 0 \
                and len(request.prompt_ids) - plan.keep < 2 * min_piece:
            return pinned
        return preamble_end(request.message_ends, [role for role, _ in request.message_info])

    def _min_piece(self) -> int:
        if self.settings.checkpoint_min_piece is not None:
            return self.settings.checkpoint_min_piece
        return int(getattr(self.engine, "checkpoint_min_piece", 0))

    # --- the generation loop ------------------------------------------------------------------

    def run(self, request: GenerationRequest) -> Iterator[OutputEvent | TokenLogprob | GenerationResult]:
        """For each of the request's ``n`` choices in turn: yield its :class:`OutputEvent` s
        (content / reasoning / tool-call pieces, from the :class:`OutputScanner`), with logprobs
        on a :class:`TokenLogprob` per generated token before the events it completes, then its
        :class:`GenerationResult` (``index`` = the choice).

        Raises EngineError / any engine exception; the history is then marked failed so the next
        request resets (the held ids may no longer match the engine state). Raises
        ``redlite.core.constraints.ConstraintError`` for a grammar llguidance rejects.
        """
        if isinstance(request, EngineTask):
            try:
                request.result = request.action(self)
            except Exception as error:
                request.error = error
            self.sequence.touch()
            return
        try:
            for index in range(max(1, request.n)):
                if index and request.cancelled.is_set():
                    return
                yield from self._run_choice(request, index)
        finally:
            if self.parking is not None:
                self.parking.request_id = None  # later parking lines (a slot task's) are no request's

    def _token_loop(self, request: GenerationRequest, index: int, logits: Any) -> HostLoop | StreamLoop:
        """The engine's token stream for this choice when it serves its sampling params, else
        host sampling. With a seed, choice i samples with ``seed + i``."""
        params = request.sampling
        if index and params.seed is not None:
            params = replace(params, seed=params.seed + index)
        if not params.needs_host:
            stream = self.engine.token_stream(params, logits)
            if stream is not None:
                return StreamLoop(stream)
        matcher = None
        if params.constraint is not None:
            from redlite.core.grammar import GrammarMatcher, grammar_tokenizer

            matcher = GrammarMatcher(params.constraint, grammar_tokenizer(self.tokenizer))
        return HostLoop(self.engine, self.engine.make_sampler(params, request.prompt_ids, matcher), logits)

    def _plan_and_execute(self, request: GenerationRequest, index: int
                          ) -> tuple[ReusePlan, float, Any, bool, Callable[[], None]]:
        """Plan the request on the held state and bring the engine to the prompt's end:
        ``(plan, clock when planned, logits, complete, miss)`` (see :meth:`_execute`);
        ``miss()`` logs the request's notes and the cache-miss line, if any, once: here before
        a prefill of more than ``SHORT_PREFILL`` tokens, else when the caller calls it after
        the first token (describing the difference decodes text and reads message boundaries)."""
        plan = adopt_held_spelling(self, request)
        prompt = request.prompt_ids
        if len(prompt) > self.engine.max_context:
            raise EngineError(f"prompt of {len(prompt)} tokens exceeds the context of {self.engine.max_context}")
        if index == 0:  # another session key: another conversation, whatever prefix it shares
            same = request.session_key is None or request.session_key == self.session_key
            self.hits = (self.hits if same else 0) + 1 if plan.keep else 0
        self.session_key = request.session_key
        miss_line = self._miss_line(plan, request)

        def miss() -> None:  # the request's notes first (a restore, a replay), then the line
            request.log_notes()
            miss_line()
        if plan.prefill > SHORT_PREFILL:
            miss()  # before a long prefill: the log says at once why it reads so much
        planned = self._clock()
        if index == 0:
            request.reused = plan.keep
        if request.launched is not None and (not 0 < plan.prefill <= SHORT_PREFILL
                                             or not self.engine.launches_async):
            request.launched()  # the client hears of the start before a long, host or no prefill
        try:
            logits, complete = self._execute(plan, request)
        except BaseException:
            miss()
            raise
        return plan, planned, logits, complete, miss

    def _miss_line(self, plan: ReusePlan, request: GenerationRequest) -> Callable[[], None]:
        """A call that logs ``plan``'s cache-miss line once (nothing for a hit): what it
        needs of the held ids is taken now, before the plan changes them."""
        line = plan.miss_line()
        if line is None:
            return lambda: None
        prompt, common, answer_start = request.prompt_ids, plan.common, self._answer_start
        mismatch = plan.reason is MissReason.TOKEN_MISMATCH
        held_next = self.held_ids[common:common + SHOWN_TOKENS] if mismatch else []
        done = [False]

        def emit() -> None:
            if done[0]:
                return
            done[0] = True
            text = line
            if mismatch:
                text += " " + describe_divergence(self.tokenizer, held_next,
                                                  prompt[common:common + SHOWN_TOKENS], common,
                                                  answer_start)
                where = describe_message(self.tokenizer, prompt, common, request.message_ends,
                                         request.message_info)
                if where:
                    text += " " + where
            if request.session_key:
                text += f" session={request.session_key}"
            log.info("%s %s", request.request_id, text)
        return emit

    def _run_choice(self, request: GenerationRequest, index: int) -> Iterator[str | TokenLogprob | GenerationResult]:
        """One choice: the candidate step, then :meth:`_answer`. The host work the candidate step
        leaves (``parking.settle``: a parked tail's bookkeeping, block hashes) runs once the
        second token is read (the first one's chunk goes out while the device computes the
        second: this thread holds the GIL while it settles), else before the choice's result,
        else when it stops (cancelled, failed, closed): not in the TTFT."""
        started = self._clock()
        if self.parking is not None and self.settings.reuse and index == 0:
            adopt_held_spelling(self, request)  # the live state's spelling first, then selection
            if len(request.prompt_ids) <= self.engine.max_context:
                # candidate selection: the live state or a parked conversation (never raises)
                self.parking.select(self, request.prompt_ids, request.request_id, request.session_key,
                                    notes=request.notes)
        selected = self._clock()
        pending = [self.parking is not None]

        def settle() -> None:
            if pending[0]:
                pending[0] = False
                self.parking.settle(self)
        try:
            yield from self._answer(request, index, started, selected, settle)
        finally:
            request.log_notes()  # not written yet when the choice failed before its plan
            settle()

    def _answer(self, request: GenerationRequest, index: int, started: float, selected: float,
                settle: Callable[[], None]) -> Iterator[str | TokenLogprob | GenerationResult]:
        """Plan, execute and generate one choice (see :meth:`run`); ``settle()`` is called
        once the second token is read and before the result (it does its work once), and
        the prefill's log line is written then too (logging is host time the TTFT need not
        wait for)."""
        plan, planned, logits, complete, miss = self._plan_and_execute(request, index)
        prompt = request.prompt_ids
        ttft_ms = (self._clock() - started) * 1000.0
        if request.launched is not None:
            request.launched()
        if not complete:
            miss()
            log.info("%s generated 0 tok, finish cancelled, held %d tok", request.request_id,
                     len(self.held_ids))
            settle()
            self.sequence.touch()
            yield GenerationResult("cancelled", len(prompt), 0, plan.keep, ttft_ms, 0.0, plan,
                                   prefilled_tokens=max(0, len(self.held_ids) - plan.keep))
            return
        pending = [True]

        def after_first() -> None:  # host work past the TTFT, once
            if pending[0]:
                pending[0] = False
                # the answer's region starts where the template's generation prompt does
                self._answer_start = request.message_ends[-1] if request.message_ends else len(prompt)
                miss()
                log.info("%s prefill %d tok (%d cached) ttft %.1f ms (select %.1f, plan %.1f, engine %.1f)%s",
                         request.request_id, plan.prefill, plan.keep, ttft_ms, 1e3 * (selected - started),
                         1e3 * (planned - selected), ttft_ms - 1e3 * (planned - started),
                         f" session={request.session_key}" if request.session_key else "")
            settle()

        max_tokens = request.max_tokens
        if self.settings.max_tokens is not None:  # the server-side cap (--max-tokens)
            max_tokens = min(max_tokens or self.settings.max_tokens, self.settings.max_tokens)
        records: list[TokenLogprob] | None = [] if request.sampling.logprobs is not None else None
        decoder = self.tokenizer.incremental_decoder()
        scanner = OutputScanner(request.stop, request.parse)
        eos = self.tokenizer.eos_token_ids
        generated = 0
        answer: list[int] = []
        finish = "length"
        decode_started: float | None = None  # when the first token was read
        loop = self._token_loop(request, index, logits)
        while not request.cancelled.is_set():
            # may the token be fed before it is looked at: no limit ends the answer at it
            ahead = (max_tokens is None or generated + 1 < max_tokens) \
                and self.engine.n_past < self.engine.max_context
            if ahead and loop.pipelined:
                self.failed = True  # until keep/drop the engine holds one token more
            token = loop.next(ahead)
            if decode_started is None:
                decode_started = self._clock()
            ending = token in eos
            if ending:
                finish = "stop"
            else:
                generated += 1
                answer.append(int(token))
                if records is not None and loop.last_logprob is not None:
                    records.append(loop.last_logprob)
                    yield loop.last_logprob
                events, stopped = scanner.push(decoder.push(token))
                yield from events
                if stopped:
                    finish, ending = "stop", True
                elif not ahead:
                    ending = True  # max_tokens or a full context: finish "length"
                elif request.cancelled.is_set():
                    finish, ending = "cancelled", True
            if ending:  # the token is not held
                loop.drop()
                self.failed = False
                break
            self.failed = True
            loop.keep(token)  # the held ids and the engine state change together here
            self.held_ids.append(token)
            self.failed = False
            if generated > 1:
                after_first()
        else:
            finish = "cancelled"
        after_first()
        if not scanner.stopped:
            events, stopped = scanner.push(decoder.flush())
            yield from events
            if stopped:
                finish = "stop"
        events, output = scanner.finish(finish)
        output.context_full = finish == "length" and (max_tokens is None or generated < max_tokens)
        yield from events
        # tokens after the first over the time since it was read (its wait is the TTFT's)
        elapsed = self._clock() - decode_started if decode_started is not None else 0.0
        rate = (generated - 1) / elapsed if generated > 1 and elapsed > 0 else 0.0
        log.info("%s generated %d tok, decode %.1f tok/s, finish %s, held %d tok",
                 request.request_id, generated, rate, output.finish_reason, len(self.held_ids))
        self.sequence.touch()  # before the result goes out: a client reading it sees the time
        yield GenerationResult(finish, len(prompt), generated, plan.keep, ttft_ms, rate, plan, output,
                               index, records, answer)
