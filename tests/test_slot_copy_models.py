"""Fork by copy under ``--parallel 4`` on tiny random torch models, in process (CPU, float32,
greedy): a tiny Llama (KV rows copied) and the tiny Qwen3.5 hybrid (KV rows of its attention
layers plus the source's checkpoint at or before the shared prefix), with the SmolLM2 tokenizer
and our Qwen3-style template (builders of tests/test_replay_tiny_models.py). An edited earlier
answer of conversation A and a new conversation with A's system prompt start from A's usable
prefix (cached tokens: that prefix, as with ``--parallel 1``), A's next turn reuses all A held,
and every answer is a cold server's."""

from __future__ import annotations

import contextlib

import pytest
from fastapi.testclient import TestClient

from redlite.core.reuse import common_prefix_length
from test_replay_tiny_models import NO_THINKING, ask, build_model_dir

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

SYSTEM = {"role": "system", "content": "You are a tiny random model that edits files. " + "Be brief. " * 12}
FIRST = {"role": "user", "content": "Tell me about files and folders."}


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    return build_model_dir(request.param, tmp_path_factory)


@contextlib.contextmanager
def server(path, parallel: int, reuse: bool = True):
    """An in-process server of ``parallel`` slots with a RAM parking pool and exact replay."""
    from redlite.core.conversations import Conversations
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GeneratorSettings
    from redlite.core.parking import ParkingPool
    from redlite.core.scheduler import build_scheduler
    from redlite.core.worker import EngineWorker
    from redlite.engine.factory import load_engine
    from redlite.server.app import ServerState, create_app
    from redlite.server.chat_service import ChatOptions

    engine, tokenizer = load_engine(str(path), ctx_size=2048, device="cpu")
    generator = Generator(engine, tokenizer, GeneratorSettings(reuse=reuse, checkpoint_interval=0))
    generator.parking = Conversations(ParkingPool(64 << 20, 8), None)
    worker = build_scheduler(generator, parallel, 8) if parallel > 1 else EngineWorker(generator)
    state = ServerState(worker, tokenizer, "tiny", engine.max_context, chat_options=ChatOptions(replay="exact"))
    try:
        with TestClient(create_app(state), base_url="http://127.0.0.1") as client:
            client.state = state
            yield client
    finally:
        worker.shutdown(wait_s=10.0)


def requests(answers: dict) -> dict:
    def text(name):
        return answers[name][0].get("content") or "" if name in answers else ""

    a2 = [SYSTEM, FIRST, {"role": "assistant", "content": text("a1")},
          {"role": "user", "content": "Now a long second question: " + "which file goes where? " * 25}]
    return {"a1": [SYSTEM, FIRST], "a2": a2,
            "b": [SYSTEM, FIRST, {"role": "assistant", "content": text("a1")[:4] + " (edited by me)"},
                  {"role": "user", "content": "Then what? " * 30}],
            "c": [SYSTEM, {"role": "user", "content": "Something else entirely: " + "rivers. " * 30}],
            "a3": a2 + [{"role": "assistant", "content": text("a2")}, {"role": "user", "content": "Third."}]}


def run(client, watch=None) -> dict:
    """Every request in order: name -> (message, usage, held after it); ``watch(name)`` is
    called before each."""
    out: dict = {}
    for name in ("a1", "a2", "b", "c", "a3"):
        if watch is not None:
            watch(name)
        out[name] = ask(client, requests(out)[name], chat_template_kwargs=NO_THINKING)
    return out


def test_forks_start_from_a_copy_of_the_shared_prefix(model_dir):
    hybrid = "qwen3_5" in model_dir.name
    slots: dict = {}  # before each request (and at the end): per slot, held ids and checkpoints

    with server(model_dir, 4) as warm:
        gens = warm.state.worker.generators

        def watch(name):
            slots[name] = [(list(g.held_ids), g.checkpoints.positions) for g in gens]

        got = run(warm, watch)
        watch("end")
    with server(model_dir, 1) as alone:
        single = run(alone)
    with server(model_dir, 1, reuse=False) as cold_client:
        cold = run(cold_client)

    cached = {name: usage["prompt_tokens_details"]["cached_tokens"] for name, (_, usage, _) in got.items()}
    a_slot = next(i for i, (ids, _) in enumerate(slots["b"]) if len(ids) == got["a2"][2])
    a_ids, checkpoints = slots["b"][a_slot]
    for name, after in (("b", "c"), ("c", "a3")):
        ran = [i for i in range(4) if slots[name][i] != slots[after][i]]
        assert len(ran) == 1 and ran[0] != a_slot and not slots[name][ran[0]][0]  # an empty slot
        assert slots[after][a_slot][0] == a_ids  # A untouched
        prompt = slots[after][ran[0]][0][:got[name][1]["prompt_tokens"]]
        common = common_prefix_length(a_ids, prompt)
        want = max(p for p in checkpoints if p <= common) if hybrid else common
        assert cached[name] == want > 40, (name, cached[name], want, common)
        assert want < len(a_ids) / 2  # less than half of A: it was not cut for it
        assert cached[name] == single[name][1]["prompt_tokens_details"]["cached_tokens"]
    assert cached["a3"] == got["a2"][2]  # A stayed resident and whole
    for name in got:
        assert got[name][0] == cold[name][0], name
        assert cold[name][1]["prompt_tokens_details"]["cached_tokens"] == 0
