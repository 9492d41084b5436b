"""Several conversations at once on the bundled model (CPU, float32, greedy, in process): four
conversations of two turns each, run together with ``--parallel 4``, give the same text as each
served alone, and their second turns reuse their first (each stayed resident in its slot)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from inprocess import async_client
from redlite.core.conversations import Conversations
from redlite.core.generation import Generator
from redlite.core.generation_request import GeneratorSettings
from redlite.core.parking import ParkingPool
from redlite.core.scheduler import build_scheduler
from redlite.core.worker import EngineWorker
from redlite.engine.factory import load_engine
from redlite.server.app import ServerState, create_app

pytestmark = pytest.mark.model

QUESTIONS = ["What is the capital of France?", "Name a colour of the sky.",
             "Write one word about cats.", "What is two plus two?"]
FOLLOW_UP = "Say it again, shorter."


@pytest.fixture(scope="module")
def model():
    return load_engine(None, ctx_size=1024, device="cpu")


@contextlib.contextmanager
def model_app(model, parallel: int, decode_ahead: bool | None = None):
    engine, tokenizer = model
    engine.reset()
    generator = Generator(engine, tokenizer, GeneratorSettings(prefill_chunk=64))
    generator.parking = Conversations(ParkingPool(64 << 20, 8), None)
    worker = build_scheduler(generator, parallel, 8, decode_ahead) if parallel > 1 else EngineWorker(generator, 8)
    assert worker is not None, "the torch engine makes sequence slots"
    state = ServerState(worker, tokenizer, engine.model_id, engine.max_context)
    try:
        yield create_app(state), worker
    finally:
        worker.shutdown(wait_s=30.0)


async def chat(client, messages, stream: bool) -> tuple[str, int]:
    body = {"messages": messages, "temperature": 0, "max_tokens": 24, "stream": stream}
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return (data["choices"][0]["message"]["content"],
                data["usage"]["prompt_tokens_details"]["cached_tokens"])
    import json
    body["stream_options"] = {"include_usage": True}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    text, cached = "", 0
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return text, cached


async def two_turns(client, question: str, stream: bool) -> tuple[list[str], int]:
    messages = [{"role": "user", "content": question}]
    first, _ = await chat(client, messages, stream)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": FOLLOW_UP}]
    second, cached = await chat(client, messages, stream)
    return [first, second], cached


@pytest.mark.parametrize("decode_ahead", [None, True])
def test_four_conversations_at_once_match_each_alone(model, decode_ahead):
    """(decode_ahead None: off on CPU; True: the executor's token streams, greedy picks fed
    back as ``PICKED``)"""
    async def together(app):
        async with async_client(app) as client:
            return await asyncio.gather(*(two_turns(client, q, i % 2 == 1)
                                          for i, q in enumerate(QUESTIONS)))

    async def alone(app):
        async with async_client(app) as client:
            return [await two_turns(client, q, i % 2 == 1) for i, q in enumerate(QUESTIONS)]

    with model_app(model, 4, decode_ahead) as (app, worker):
        got = asyncio.run(asyncio.wait_for(together(app), 600))
        assert worker.executor.batched_tokens > worker.executor.batches  # batched decode ran
    with model_app(model, 1) as (app, _):
        expected = asyncio.run(asyncio.wait_for(alone(app), 600))
    assert [texts for texts, _ in got] == [texts for texts, _ in expected]
    assert all(cached > 10 for _, cached in got)  # second turns reused their own first
    assert "Paris" in got[0][0][0]


def test_a_seeded_sampled_answer_is_the_same_whatever_else_runs(model):
    sampled = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0.9,
               "seed": 7, "max_tokens": 16, "logprobs": True, "top_logprobs": 2}

    async def ask(client, body):
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], [
            (t["token"], round(t["logprob"], 3)) for t in choice["logprobs"]["content"]]

    async def together(app):
        async with async_client(app) as client:
            others = [dict(sampled, seed=None, temperature=0, messages=[{"role": "user", "content": q}])
                      for q in QUESTIONS[:2]]
            return (await asyncio.gather(*(ask(client, b) for b in [sampled, *others])))[0]

    async def alone(app):
        async with async_client(app) as client:
            return await ask(client, sampled)

    with model_app(model, 3) as (app, _):
        got = asyncio.run(asyncio.wait_for(together(app), 600))
    with model_app(model, 1) as (app, _):
        expected = asyncio.run(asyncio.wait_for(alone(app), 600))
    assert got == expected and len(got[1]) == 16
