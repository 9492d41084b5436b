"""Start-up and shutdown of the server process (uvicorn).

SIGINT/SIGTERM: the running generation is stopped through its output path (its stream ends
cleanly), waiting requests get 503 ``server is shutting down``, new connections are refused,
the conversations are saved to ``--session-dir`` (when given) and the process exits with
status 0.
"""

from __future__ import annotations

import argparse
import logging
import socket
import time
from pathlib import Path

import uvicorn

from redlite.core.conversations import Conversations
from redlite.core.generation import Generator, GeneratorSettings
from redlite.core.parking import ParkingPool
from redlite.core.sessions import SessionStore, expected_for
from redlite.core.worker import EngineWorker
from redlite.server.app import ServerState, create_app
from redlite.server.slots import SlotService
from redlite.server.http_protocol import HeaderTimeoutProtocol

log = logging.getLogger("redlite")


def build_parking(args: argparse.Namespace, expected) -> Conversations:
    """The RAM pool (``--park-mib``, ``--park-slots``) and, with ``--session-dir``, the disk tier
    indexed now (so a saved conversation's first request is restored from disk)."""
    pool = ParkingPool(int(args.park_mib * (1 << 20)), args.park_slots)
    sessions = None
    if args.session_dir:
        sessions = SessionStore(args.session_dir, expected, min_tokens=args.session_min_tokens,
                                keep=args.session_keep, max_bytes=int(args.session_max_gb * (1 << 30)))
        sessions.scan()
    return Conversations(pool, sessions)


def save_on_stop(worker: EngineWorker, parking: Conversations) -> None:
    """Normal stop: once the running request has stopped, save the conversations to disk."""
    if parking.sessions is None:
        return
    worker.shutdown(wait_s=30.0)
    if worker.busy:
        log.warning("the engine is still busy: conversations not saved")
        return
    saved = parking.save_all(worker.generator)
    log.info("stop: %d conversations on disk", saved)


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer) for the CLI options; the torch stack is imported only when used."""
    if args.engine == "echo":
        from redlite.core.byte_tokenizer import ByteTokenizer
        from redlite.engine.echo import EchoEngine
        engine = EchoEngine(can_rewind=not args.echo_no_rewind,
                            max_context=args.ctx_size or 1 << 20, delay_ms=args.echo_delay_ms)
        return engine, ByteTokenizer()
    from redlite.engine.factory import load_engine
    return load_engine(args.model, ctx_size=args.ctx_size, device=args.device, dtype=args.dtype,
                       int4_decode=args.int4_decode)


class _Server(uvicorn.Server):
    """uvicorn's server, plus: stop the engine worker first on a signal; log cold start."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, cold_start) -> None:
        super().__init__(config)
        self._worker, self._cold_start = worker, cold_start

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            log.info("signal %s: stopping the running generation, refusing waiting requests", sig)
            self._worker.shutdown(wait_s=0.0)
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after its shutdown (the process would then die of
        # the signal); a requested stop is a normal exit with status 0.
        self._captured_signals.clear()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("listening on http://%s:%d (cold start %.2f s from process start)",
                     self.config.host, self.config.port, self._cold_start())


def bind_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket for ``host:port`` (IPv6 when the host has a colon); raises OSError
    when the address is in use or invalid."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit status (0 on a normal
    stop, 1 when the address cannot be bound)."""
    from redlite.cli import process_age_s

    # Take the port before loading the model, so a busy port fails at once, not after a load.
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, error)
        return 1
    started = time.perf_counter()
    engine, tokenizer = build_engine(args)
    log.info("engine %s model %s context %d tokens, loaded in %.2f s", args.engine,
             engine.model_id, engine.max_context, time.perf_counter() - started)
    settings = GeneratorSettings(reuse=not args.no_reuse, checkpoint_interval=args.checkpoint_interval,
                                 checkpoint_bytes=int(args.checkpoint_mib * (1 << 20)))
    generator = Generator(engine, tokenizer, settings)
    # what saved files must match (fingerprints the weights: only when files are used)
    expected = expected_for(engine) if args.session_dir or args.slot_save_path else None
    parking = build_parking(args, expected)
    generator.parking = parking
    worker = EngineWorker(generator, max_queue=args.queue)
    slots = None
    if args.slot_save_path:
        Path(args.slot_save_path).mkdir(parents=True, exist_ok=True)
        slots = SlotService(Path(args.slot_save_path), worker, expected)
    state = ServerState(worker, tokenizer, engine.model_id, engine.max_context,
                        max_body_bytes=int(args.max_body_mib * (1 << 20)),
                        body_timeout_s=args.body_timeout_s, slots=slots)
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port,
                            log_level="warning", timeout_graceful_shutdown=3,
                            http=HeaderTimeoutProtocol)
    config.header_timeout_s = args.header_timeout_s
    server = _Server(config, worker, process_age_s)
    server.run(sockets=[listener])
    save_on_stop(worker, parking)
    worker.shutdown(wait_s=1.0)
    return 0
