"""Message boundaries the first token does not need are computed after it
(:class:`redlite.core.tokenizer.LazyPositions`): on an engine that rewinds, a request's
``message_ends`` are read once its second token is out (the answer's start, the cache-miss
line), not before its prefill; an engine that checkpoints reads them before (split points)."""

import logging

import pytest

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import SHORT_PREFILL, Generator
from redlite.core.generation_request import GenerationRequest, GeneratorSettings
from redlite.core.replay_splice import _mapped_ends
from redlite.core.tokenizer import LazyPositions, RenderedPrompt
from redlite.core.worker import Job, run_job
from redlite.engine.echo import EchoEngine

pytestmark = pytest.mark.timeout(30)


def test_lazy_positions_compute_once_when_first_read():
    calls = []
    ends = LazyPositions(lambda: calls.append(1) or (3, 7, 9))
    assert not ends.known and calls == []
    assert len(ends) == 3 and ends[-1] == 9 and list(ends) == [3, 7, 9] and ends[1:] == [7, 9]
    assert ends == [3, 7, 9] and ends != [3, 7] and ends.known and calls == [1]
    assert bool(LazyPositions(list)) is False


def test_a_rendered_prompt_defers_its_ends_until_read():
    computed = []
    prompt = RenderedPrompt([1, 2, 3], lambda: computed.append(1) or [2, 3], "abc")
    deferred = prompt.deferred_ends()
    assert isinstance(deferred, LazyPositions) and computed == []
    assert list(deferred) == [2, 3] and prompt.message_ends == [2, 3] and computed == [1]
    assert prompt.deferred_ends() == [2, 3] and not isinstance(prompt.deferred_ends(), LazyPositions)


def test_spliced_ends_map_into_the_spliced_ids():
    # pieces: marked [0, 10) -> spliced 0, [14, 20) -> spliced 30 (a turn grew from 4 to 20 ids)
    spans = [(0, 10, 0), (14, 20, 30)]
    assert _mapped_ends([5, 10, 12, 18, 20], spans) == [5, 10, 34, 36]


def _request(ids, ends, reads, **kwargs):
    def compute():
        reads.append(len(events))
        return ends
    events: list[str] = []
    return GenerationRequest(ids, message_ends=LazyPositions(compute), **kwargs), events


def _run(gen, request, events):
    def note(event):
        if event.kind != "done":
            events.append(event.kind)
    real = gen.engine.prefill
    gen.engine.prefill = lambda ids: events.append("prefill") or real(ids)
    run_job(gen, Job(request, note))
    gen.engine.prefill = real


def test_a_rewinding_engine_reads_message_ends_after_the_second_token():
    gen = Generator(EchoEngine(), ByteTokenizer())
    ids = [65 + i % 26 for i in range(40)]
    reads: list[int] = []
    request, events = _request(ids, [10, 39], reads, max_tokens=4)
    _run(gen, request, events)
    assert reads, "never read"
    before = events[:reads[0]]
    assert before.count("prefill") == 1
    assert before.count("output") >= 2  # read after the second token
    assert gen._answer_start == 39


def test_a_miss_line_is_written_after_the_first_token_and_names_the_message(caplog):
    gen = Generator(EchoEngine(), ByteTokenizer())
    first = [65 + i % 26 for i in range(40)]
    run_job(gen, Job(GenerationRequest(first, max_tokens=4, message_ends=[20, 40]), lambda e: None))
    changed = first[:30] + [90] * 10
    reads: list[int] = []
    request, events = _request(changed, [20, 40], reads, max_tokens=4,
                               message_info=[("user", None), ("user", None)])
    with caplog.at_level(logging.INFO, logger="redlite.generation"):
        _run(gen, request, events)
    line = next(m for m in caplog.messages if "cache miss" in m)
    assert "at token 30" in line and "message=1 role=user offset=" in line
    assert "output" in events[:reads[0]]


def test_a_checkpointing_engine_reads_message_ends_before_its_prefill():
    engine = EchoEngine()
    engine.can_rewind = False
    gen = Generator(engine, ByteTokenizer(), GeneratorSettings(checkpoint_bytes=1 << 20))
    ids = [65 + i % 26 for i in range(300)]
    reads: list[int] = []
    request, events = _request(ids, [150, 300], reads, max_tokens=2)
    _run(gen, request, events)
    assert reads and "prefill" not in events[:reads[0]]
    assert 150 in gen.checkpoints.positions


def test_before_a_long_prefill_the_miss_line_comes_first():
    gen = Generator(EchoEngine(), ByteTokenizer())
    first = [65 + i % 26 for i in range(40)]
    run_job(gen, Job(GenerationRequest(first, max_tokens=4, message_ends=[20, 40]), lambda e: None))
    changed = first[:30] + [90] * (SHORT_PREFILL + 10)
    reads: list[int] = []
    request, events = _request(changed, [20, len(changed)], reads, max_tokens=2,
                               message_info=[("user", None), ("user", None)])
    _run(gen, request, events)
    assert reads and "prefill" not in events[:reads[0]]


def test_a_checkpointing_engine_leaves_them_unread_before_a_short_second_turn():
    """With a minimum piece (the GPU's), a second turn's short prefill has no cut to make: the
    held conversation's pinned preamble stands in for the prompt's, and the boundaries wait
    until after the first token."""
    engine = EchoEngine()
    engine.can_rewind = False
    engine.checkpoint_min_piece = 64
    gen = Generator(engine, ByteTokenizer(), GeneratorSettings(checkpoint_bytes=1 << 20))
    first = [65 + i % 26 for i in range(300)]
    roles = [("system", None), ("user", None)]
    reads: list[int] = []
    request, events = _request(first, [200, 300], reads, max_tokens=2, message_info=roles)
    _run(gen, request, events)
    assert reads and "prefill" not in events[:reads[0]]  # a long first prefill: cut at 200
    assert gen.checkpoints.pinned == 200 and 200 in gen.checkpoints.positions
    second = gen.held_ids + [66] * 20
    reads = []
    request, events = _request(second, [200, 300, len(second)], reads, max_tokens=4,
                               message_info=roles + [("assistant", None), ("user", None)])
    _run(gen, request, events)
    assert reads and "output" in events[:reads[0]], events
    assert gen.checkpoints.pinned == 200 and len(second) in gen.checkpoints.positions
