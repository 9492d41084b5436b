"""When a job reports ``started`` (redlite.core.worker.run_job, GenerationRequest.launched):
before the prefill on a host engine and for long prompts, after a short prefill is queued on
an engine that launches asynchronously (the HTTP side's response start then overlaps the
device's work instead of contending with selection and launch)."""

import pytest

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.generation import SHORT_PREFILL, Generator
from redlite.core.generation_request import GenerationRequest
from redlite.core.worker import Job, run_job
from redlite.engine.echo import EchoEngine

pytestmark = pytest.mark.timeout(30)


def order_of(engine, prompt_len, extend_by=None):
    """The order of the engine's prefills and the job's events for a prompt of ``prompt_len``
    ids (after one of ``extend_by`` ids when given: only the new ids are prefilled)."""
    gen = Generator(engine, ByteTokenizer())
    order = []
    real = engine.prefill
    engine.prefill = lambda ids: order.append(f"prefill {len(ids)}") or real(ids)
    ids = [65 + i % 26 for i in range(prompt_len)]
    if extend_by is not None:
        run_job(gen, Job(GenerationRequest(ids[:extend_by], max_tokens=1), lambda e: None))
        order.clear()
    run_job(gen, Job(GenerationRequest(ids, max_tokens=2), lambda e: order.append(e.kind)))
    return order[:order.index("done") + 1]


@pytest.mark.parametrize("launches_async", [False, True])
def test_started_comes_once_and_first_of_the_events(launches_async):
    engine = EchoEngine()
    engine.launches_async = launches_async
    order = order_of(engine, 20)
    events = [e for e in order if not e.startswith("prefill")]
    assert events[0] == "started" and events.count("started") == 1 and events[-1] == "done"


def test_a_host_engine_reports_started_before_its_prefill():
    assert order_of(EchoEngine(), 20)[:2] == ["started", "prefill 20"]


def test_an_async_engine_reports_started_once_a_short_prefill_is_queued():
    engine = EchoEngine()
    engine.launches_async = True
    assert order_of(engine, 20)[:2] == ["prefill 20", "started"]
    assert order_of(engine, 500, extend_by=500 - SHORT_PREFILL)[:2] == [f"prefill {SHORT_PREFILL}", "started"]


def test_an_async_engine_reports_started_before_a_long_prefill():
    engine = EchoEngine()
    engine.launches_async = True
    assert order_of(engine, SHORT_PREFILL + 1)[:2] == ["started", f"prefill {SHORT_PREFILL + 1}"]


def test_an_async_engine_with_nothing_to_prefill_reports_started_before_the_restore():
    """A regenerate on an engine without rewind: the checkpoint at the prompt's end holds the
    logits, so no device work follows that the response's start could overlap."""
    engine = EchoEngine(can_rewind=False)
    engine.launches_async = True
    gen = Generator(engine, ByteTokenizer())
    ids = [65 + i % 26 for i in range(40)]
    run_job(gen, Job(GenerationRequest(ids, max_tokens=3), lambda e: None))
    order = []
    real_restore, real_prefill = engine.restore_checkpoint, engine.prefill
    engine.restore_checkpoint = lambda c: order.append("restore") or real_restore(c)
    engine.prefill = lambda t: order.append("prefill") or real_prefill(t)
    run_job(gen, Job(GenerationRequest(ids, max_tokens=3), lambda e: order.append(e.kind)))
    assert order[:2] == ["started", "restore"] and "prefill" not in order
