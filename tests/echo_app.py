"""The ASGI app with the echo engine, in process (no server subprocess), for protocol tests."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.conversations import Conversations
from redlite.core.generation import Generator
from redlite.core.generation_request import GeneratorSettings
from redlite.core.parking import ParkingPool
from redlite.core.sessions import expected_for
from redlite.core.scheduler import build_scheduler
from redlite.core.worker import EngineWorker
from redlite.engine.echo import EchoEngine
from redlite.server.app import ServerState, create_app
from redlite.server.security import SecurityOptions
from redlite.server.slots import SlotService


def echo_state(slot_dir: Path | None = None, security: SecurityOptions | None = None,
               max_tokens: int | None = None, park_device_bytes: int = 0, parking=None,
               parallel: int = 1, engine: EchoEngine | None = None, max_queue: int = 4,
               prefill_chunk: int = 1 << 30, merged: tuple[bytes, ...] = (),
               same_bytes: bool = True, decode_ahead: bool = True, **state_fields) -> ServerState:
    """A ServerState over a fresh echo engine and worker thread (stop it with
    ``state.worker.shutdown()``); ``max_tokens``: the server-side cap (``--max-tokens``);
    ``park_device_bytes``: ``--park-device-mib`` in bytes (the engine then counts as holding
    its state in device memory); ``parking(engine)``: the generator's Conversations instead of
    a 1 MiB, 4-entry pool; ``parallel``: ``--parallel`` (a Scheduler of that many slots when
    > 1); ``engine``: the echo engine to serve (default: a fresh rewindable one). ``merged``:
    multi-byte tokens the engine writes and the tokenizer never does (a re-tokenizing answer;
    with a given ``engine``, give it the same); ``same_bytes``: :class:`GeneratorSettings` field;
    ``decode_ahead``: off is ``--no-decode-ahead``."""
    engine = engine or EchoEngine(device_resident=park_device_bytes > 0, merged=merged)
    # one prefill call per request whatever its length, so tests can count requests' prefills
    generator = Generator(engine, ByteTokenizer(merged), GeneratorSettings(
        prefill_chunk=prefill_chunk, max_tokens=max_tokens, same_bytes=same_bytes))
    generator.parking = (parking(engine) if parking is not None else
                         Conversations(ParkingPool(1 << 20, 4, device_budget_bytes=park_device_bytes),
                                       None))
    worker = build_scheduler(generator, parallel, max_queue, decode_ahead) if parallel > 1 else None
    worker = worker or EngineWorker(generator, max_queue=max_queue)
    slots = None
    if slot_dir is not None:
        slot_dir.mkdir(parents=True, exist_ok=True)
        slots = SlotService(slot_dir, worker, expected_for(engine))
    return ServerState(worker, ByteTokenizer(merged), engine.model_id, engine.max_context, slots=slots,
                       security=security or SecurityOptions(), **state_fields)


@contextmanager
def echo_client(base_url: str = "http://127.0.0.1", **kwargs):
    """A TestClient on a fresh echo app; ``kwargs`` go to :func:`echo_state`."""
    state = echo_state(**kwargs)
    try:
        with TestClient(create_app(state), base_url=base_url,
                        raise_server_exceptions=False) as client:
            client.state = state
            yield client
    finally:
        state.worker.shutdown(wait_s=2.0)
