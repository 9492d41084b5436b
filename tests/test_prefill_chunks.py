"""Chunked, interruptible prefill and the held-ids/engine consistency check (Generator, in
process, echo engine), and the --max-tokens cap."""

import pytest

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult, GeneratorSettings
from redlite.core.reuse import Action, MissReason
from redlite.engine.echo import EchoEngine

tok = ByteTokenizer()
MESSAGES = [{"role": "user", "content": "abcdefghij" * 10}]  # one boundary, at the end


class CancelAfter(EchoEngine):
    """Sets a request's ``cancelled`` after ``n`` prefill calls."""

    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n, self.request = n, None

    def prefill(self, token_ids):
        logits = super().prefill(token_ids)
        if self.prefill_calls == self.n and self.request is not None:
            self.request.cancelled.set()
        return logits


class FailOnCall(EchoEngine):
    """The ``n``-th prefill call takes its tokens into the state, then raises (an out-of-memory
    error half-way through a chunk, say)."""

    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def prefill(self, token_ids):
        logits = super().prefill(token_ids)
        if self.prefill_calls == self.n:
            raise RuntimeError("out of memory (injected)")
        return logits


def run(gen, messages=MESSAGES, **fields):
    rendered = tok.render_chat(messages)
    request = GenerationRequest(rendered.token_ids, message_ends=rendered.message_ends, **fields)
    if hasattr(gen.engine, "request"):
        gen.engine.request = request
    out = list(gen.run(request))
    assert isinstance(out[-1], GenerationResult)
    return "".join(event.value for event in out[:-1]), out[-1]


@pytest.mark.parametrize("can_rewind", [True, False])
def test_cancel_between_chunks_keeps_the_prefilled_prefix(can_rewind):
    engine = CancelAfter(3, can_rewind=can_rewind)
    gen = Generator(engine, tok, GeneratorSettings(prefill_chunk=16, checkpoint_interval=1000))
    prompt = tok.render_chat(MESSAGES).token_ids
    text, result = run(gen)
    assert (text, result.finish_reason, result.completion_tokens) == ("", "cancelled", 0)
    assert gen.held_ids == prompt[:48] == engine.held_ids  # exactly the three chunks prefilled
    assert not gen.failed
    engine.request = None
    before = engine.prefilled_tokens
    text, result = run(gen)  # the same prompt again continues where the prefill stopped
    assert result.cached_tokens == 48 and result.plan.action is Action.EXTEND
    assert engine.prefilled_tokens - before == len(prompt) - 48
    assert text == MESSAGES[-1]["content"]


def test_chunks_are_at_most_prefill_chunk_tokens():
    engine = EchoEngine()
    gen = Generator(engine, tok, GeneratorSettings(prefill_chunk=10))
    prompt = tok.render_chat(MESSAGES).token_ids
    run(gen)
    assert engine.prefill_calls == -(-len(prompt) // 10)


@pytest.mark.parametrize("can_rewind", [True, False])
def test_a_failing_later_chunk_makes_the_next_plan_reset_after_failure(can_rewind):
    engine = FailOnCall(3, can_rewind=can_rewind)
    gen = Generator(engine, tok, GeneratorSettings(prefill_chunk=16, checkpoint_interval=1000))
    with pytest.raises(RuntimeError):
        run(gen)
    assert engine.n_past == 48 and len(gen.held_ids) == 32  # the engine is ahead
    plan = gen.plan(tok.render_chat(MESSAGES).token_ids)
    assert (plan.action, plan.reason) == (Action.RESET, MissReason.AFTER_FAILURE)
    text, result = run(gen)
    assert text == MESSAGES[-1]["content"] and result.cached_tokens == 0
    assert gen.held_ids == engine.held_ids


def test_held_ids_that_disagree_with_the_engine_reset_even_without_the_failed_flag():
    engine = EchoEngine()
    gen = Generator(engine, tok)
    run(gen)
    engine.prefill([1, 2, 3])  # the engine moved on behind the generator's back
    assert not gen.failed
    plan = gen.plan(list(gen.held_ids) + [4])
    assert (plan.action, plan.reason) == (Action.RESET, MissReason.AFTER_FAILURE)


@pytest.mark.parametrize("requested, cap, expected, finish", [
    (None, 5, 5, "length"), (50, 5, 5, "length"), (3, 5, 3, "length"), (None, None, 100, "stop")])
def test_server_side_max_tokens_cap(requested, cap, expected, finish):
    gen = Generator(EchoEngine(), tok, GeneratorSettings(max_tokens=cap))
    text, result = run(gen, max_tokens=requested)
    assert result.completion_tokens == expected and len(text) == expected
    assert result.finish_reason == finish
