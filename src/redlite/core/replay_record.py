"""Keeping a finished answer for exact replay (:mod:`redlite.core.replay`); torch-free."""

from __future__ import annotations

import logging
from typing import Any

from redlite.core.replay_splice import decode_rendered
from redlite.core.replay import (MAX_PREFIX_TOKENS, GeneratedTurn, ReplayStore, canonical_arguments,
                                  context_key)

log = logging.getLogger("redlite.replay")


def record_turn(store: ReplayStore, tokenizer: Any, request: Any, result: Any,
                last_message: object = None) -> GeneratedTurn | None:
    """Keep ``result`` (a :class:`redlite.core.generation_request.GenerationResult`) of ``request`` (its
    :class:`GenerationRequest`); last_message: the chat request's last message (the one the
    answer follows). Not kept: a cancelled answer, one cut by a stop sequence (the
    client's copy lacks the stop text the model saw), one with a dropped call (cut by
    ``max_tokens`` or malformed: the client's copy lacks its text, so the kept ids are not what
    the client sends back; kept, it would put the unfinished call back into the prompt), and a
    prompt whose generation prompt (the ids after its last message boundary) is unknown or
    longer than :data:`MAX_PREFIX_TOKENS`."""
    output = result.output
    if result.finish_reason == "cancelled" or output.stop_sequence is not None:
        return None
    if output.dropped_calls:
        log.info("%s replay: answer not kept: %d unfinished or malformed call(s) the client "
                 "does not get", getattr(request, "request_id", ""), output.dropped_calls)
        return None
    if not request.message_ends or not result.answer_ids:
        return None
    start = request.message_ends[-1]
    prefix = list(request.prompt_ids[start:])
    if not prefix or len(prefix) > MAX_PREFIX_TOKENS:
        return None
    turn = GeneratedTurn(prefix, decode_rendered(tokenizer, prefix), list(result.answer_ids),
                         output.content, output.reasoning,
                         tuple((c.id, c.name, canonical_arguments(c.arguments)) for c in output.tool_calls),
                         context_key(last_message), start)
    store.record(turn)
    return turn
