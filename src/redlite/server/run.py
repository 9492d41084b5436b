"""Start-up and shutdown of the server process (uvicorn).

SIGINT/SIGTERM at any phase: see :mod:`redlite.server.shutdown` (503s for the running and
waiting requests, conversations saved to ``--session-dir``, a second signal exits at once,
exit status 0, never an abort).
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from redlite.core.conversations import Conversations
from redlite.core.generation import Generator
from redlite.core.generation_request import GeneratorSettings
from redlite.core.parking import ParkingPool
from redlite.core.session_dir import SessionDirError, prepare_session_dir
from redlite.core.private_files import make_private_dir
from redlite.core.sessions import SessionStore, expected_for
from redlite.core.scheduler import Scheduler, build_scheduler
from redlite.core.worker import EngineWorker
from redlite.server.app import ServerState, create_app
from redlite.server.chat_service import ChatOptions
from redlite.server.security import security_from_args
from redlite.server.slots import SlotService
from redlite.server.http_protocol import HeaderTimeoutProtocol
from redlite.server.shutdown import Stopper, leave
from redlite.server.tokenizer_prep import start_tokenizer_prep

log = logging.getLogger("redlite")


def build_parking(args: argparse.Namespace, expected) -> Conversations:
    """The RAM pool (``--park-mib``, ``--park-slots``, ``--park-device-mib`` for entries kept in
    device memory) and, with ``--session-dir``, the disk tier indexed now (so a saved
    conversation's first request is restored from disk)."""
    device_mib = getattr(args, "park_device_mib", 0.0)
    pool = ParkingPool(int(args.park_mib * (1 << 20)), args.park_slots,
                       device_budget_bytes=int(device_mib * (1 << 20)))
    sessions = None
    if args.session_dir:
        sessions = SessionStore(args.session_dir, expected, min_tokens=args.session_min_tokens,
                                keep=args.session_keep, max_bytes=int(args.session_max_gb * (1 << 30)))
        sessions.scan()
    return Conversations(pool, sessions)


def save_on_stop(worker: EngineWorker | Scheduler, parking: Conversations, stopper: Stopper,
                 wait_s: float = 30.0) -> None:
    """After serving: let the engine stop (its running job is cancelled: at most one prefill
    chunk or token), then save the conversations to disk. A second signal skips the waiting
    and every file not yet started. RAM-parked conversations need no engine: they are saved
    even when the engine does not stop in time; the live one only when it is idle."""
    worker.shutdown(wait_s=0.0)
    idle = stopper.wait(worker.join, wait_s)
    if parking.sessions is None or stopper.immediate.is_set():
        return
    if not idle:
        log.warning("the engine is still busy after %.0f s: saving the parked conversations only",
                    wait_s)
    saved = parking.save_all(worker.generator, live=idle, should_stop=stopper.immediate.is_set,
                             guard=stopper.writing, residents=worker.generators[1:])
    parking.sessions.close()  # its owner lock: the files it wrote are now adoptable
    log.info("stop: %d conversations on disk (written now or already saved unchanged)", saved)


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer) for the CLI options; the torch stack is imported only when used.
    Raises ValueError for ``--kv-dtype`` other than auto with the echo engine (no KV cache)."""
    if args.engine == "echo":
        if getattr(args, "kv_dtype", "auto") != "auto":
            raise ValueError(f"--kv-dtype {args.kv_dtype}: the echo engine has no KV cache "
                             "(its state is token ids); leave --kv-dtype at auto")
        from redlite.core.byte_tokenizer import ByteTokenizer
        from redlite.engine.echo import EchoEngine
        engine = EchoEngine(can_rewind=not args.echo_no_rewind,
                            max_context=args.ctx_size or 1 << 20, delay_ms=args.echo_delay_ms,
                            prefill_delay_ms=args.echo_prefill_delay_ms,
                            snapshot_delay_ms=args.echo_snapshot_delay_ms)
        return engine, ByteTokenizer()
    from redlite.engine.factory import load_engine
    from redlite.engine.kernel_options import kernel_options_from_args
    return load_engine(args.model, ctx_size=args.ctx_size, device=args.device, dtype=args.dtype,
                       kernels=kernel_options_from_args(args), cache_dir=getattr(args, "cache_dir", None))


@dataclass
class BuiltServer:
    """One whole redlite server without its listener: the ASGI app, the engine worker it
    submits to, and the conversation tiers (RAM pool, ``--session-dir``)."""

    app: Any
    worker: EngineWorker | Scheduler
    parking: Conversations
    model_id: str
    tokenizer: Any = None


def build_server(args: argparse.Namespace, security=None) -> BuiltServer:
    """Load the engine and build the app for the ``redlite serve`` options (shared by
    ``redlite serve`` and each replica of ``redlite serve-cluster``). security: the parsed
    API-key options (None: read from ``args``; raises OSError/ValueError when unreadable)."""
    if security is None:
        security = security_from_args(args)
    started = time.perf_counter()
    engine, tokenizer = build_engine(args)
    log.info("engine %s model %s context %d tokens, loaded in %.2f s", args.engine,
             engine.model_id, engine.max_context, time.perf_counter() - started)
    if getattr(args, "batch_invariant", False):
        where = getattr(getattr(engine, "device", None), "type", "cpu")
        log.info("--batch-invariant: %s", "batched steps use the row-by-row products" if where == "cuda" else
                 f"no effect on {where} (quantized weights batch bitwise as alone there; dense ones "
                 "agree up to rounding)")
    settings = GeneratorSettings(reuse=not args.no_reuse, checkpoint_interval=args.checkpoint_interval,
                                 checkpoint_min_piece=getattr(args, "checkpoint_min_piece", None),
                                 checkpoint_bytes=int(args.checkpoint_mib * (1 << 20)),
                                 prefill_chunk=max(1, args.prefill_chunk),
                                 max_tokens=args.max_tokens if args.max_tokens > 0 else None,
                                 same_bytes=args.replay == "exact")
    if getattr(args, "warmup", True):
        from redlite.engine.warmup import warm_up
        warm_up(engine, tokenizer, max(1, args.prefill_chunk))
    if hasattr(tokenizer, "prompt_limit"):
        tokenizer.prompt_limit = engine.max_context  # refuse provably long chats before tokenizing
    log.info("chat template: at least %d special tokens per user/assistant turn (for refusing "
             "too-long chats before rendering)", getattr(tokenizer, "turn_tokens", 0))
    generator = Generator(engine, tokenizer, settings)
    # what saved files must match (fingerprints the weights: only when files are used)
    expected = expected_for(engine) if args.session_dir or args.slot_save_path else None
    parking = build_parking(args, expected)
    generator.parking = parking
    worker = None
    if getattr(args, "parallel", 1) > 1:
        worker = build_scheduler(generator, args.parallel, max_queue=args.queue,
                                 decode_ahead={"on": True, "off": False}.get(getattr(args, "decode_ahead", "auto")),
                                 warm=getattr(args, "warmup", True))
    if worker is None:
        worker = EngineWorker(generator, max_queue=args.queue)
    slots = None
    if args.slot_save_path:
        make_private_dir(args.slot_save_path)
        slots = SlotService(Path(args.slot_save_path), worker, expected)
    state = ServerState(worker, tokenizer, engine.model_id, engine.max_context,
                        max_body_bytes=int(args.max_body_mib * (1 << 20)),
                        body_timeout_s=args.body_timeout_s, slots=slots, security=security,
                        chat_options=ChatOptions(args.tool_parser, args.reasoning_parser,
                                                 replay=args.replay),
                        metrics=args.metrics)
    return BuiltServer(create_app(state), worker, parking, engine.model_id, tokenizer)


class _Server(uvicorn.Server):
    """uvicorn's server, plus: stop signals go through the process's :class:`Stopper` (the
    first stops the engine worker before uvicorn stops; a later one forces uvicorn out, whatever
    the signal); log cold start, then call ``after_start()`` (when given)."""

    def __init__(self, config: uvicorn.Config, stopper: Stopper, cold_start, after_start=None) -> None:
        super().__init__(config)
        self._stopper, self._cold_start, self._after_start = stopper, cold_start, after_start

    def handle_exit(self, sig, frame) -> None:
        self._stopper.handle(sig, frame)

    def stop(self) -> None:
        self.should_exit = True

    def force(self) -> None:
        self.should_exit = self.force_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("listening on http://%s:%d (cold start %.2f s from process start)",
                     self.config.host, self.config.port, self._cold_start())
            if self._after_start is not None:
                self._after_start()


def uvicorn_config(app, host: str, port: int, header_timeout_s: float) -> uvicorn.Config:
    """uvicorn's settings for serving ``app``. The ASGI lifespan protocol is off: the app has
    no start-up or shutdown handlers, and a second stop signal that forces uvicorn out before
    the lifespan's shutdown leaves that task to be cancelled, which uvicorn logs as an error
    with a traceback."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=10, http=HeaderTimeoutProtocol)
    config.header_timeout_s = header_timeout_s
    return config


def freeze_imported_modules(engine: str) -> int:
    """Import the engine's modules now (torch's for ``torch``) and move every object alive
    (the imported modules' ~300k objects, which live as long as the process) out of the cyclic
    garbage collector's reach (:func:`gc.freeze`), without collecting first: the collection
    in :func:`freeze_startup_objects` then walks only what loading made (0.2-0.4 s less at
    start-up). The few cyclic leftovers of imports are kept for good. Returns the objects
    frozen so far."""
    if engine == "torch":
        import torch  # noqa: F401 - imported for the freeze
        import redlite.engine.factory  # noqa: F401
    gc.freeze()
    return gc.get_freeze_count()


def freeze_startup_objects() -> int:
    """Collect, then move every object alive now (the model, the tokenizer, imported modules:
    ~300k objects with the bundled model) out of the cyclic garbage collector's reach
    (:func:`gc.freeze`). Otherwise the full collection that a few large requests trigger walks
    them all, ~0.5 s holding the GIL, stalling every other request. Turns the collector on
    (the CLI starts with it off: each full collection while torch imports walks every object
    made so far). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


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


def serve(args: argparse.Namespace, stopper: Stopper | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit status (0 on a stop by a
    signal at any phase, 1 when the address cannot be bound, the API keys or the session
    directory cannot be used, or the model is missing or unsupported: one error line); see
    :mod:`redlite.server.shutdown`.
    stopper: the process's signal handling, installed early by the CLI (None: installed here)."""
    from redlite.cli import process_age_s

    try:
        security = security_from_args(args)
    except (OSError, ValueError) as error:
        log.error("cannot read the API keys: %s", error)
        return 1
    # Take the port before loading the model, so a busy port fails at once, not after a load.
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, error)
        return 1
    try:  # a session directory that cannot be used fails now, not after the model loads
        if args.session_dir:
            prepare_session_dir(args.session_dir)
    except SessionDirError as error:
        log.error("%s", error)
        return 1
    if stopper is None:
        stopper = Stopper()
        stopper.install()
    serving = threading.Event()
    # a signal while loading: stop once loaded; a second one: at once
    stopper.on_second.append(lambda: None if serving.is_set() else leave(0, True))
    if stopper.requested.is_set():
        return leave(0, False)
    log.info("loading engine %s", args.engine)
    freeze_imported_modules(args.engine)
    try:
        built = build_server(args, security)
    except (FileNotFoundError, ValueError) as error:  # a missing or unsupported --model
        log.debug("model load failed", exc_info=True)
        log.error("cannot load the model: %s", error)
        return 1
    worker, parking = built.worker, built.parking
    if stopper.requested.is_set():
        worker.shutdown(wait_s=0.0)
        return leave(0, False)
    config = uvicorn_config(built.app, args.host, args.port, args.header_timeout_s)
    server = _Server(config, stopper, process_age_s,
                     after_start=lambda: start_tokenizer_prep(built.tokenizer))
    stopper.on_first += [lambda: worker.shutdown(wait_s=0.0), server.stop]
    stopper.on_second.append(server.force)
    if not stopper.requested.is_set():
        log.info("%d startup objects frozen out of the garbage collector's scans",
                 freeze_startup_objects())
        serving.set()
        server.run(sockets=[listener])
    # from here a second signal ends the process at once (after a file being written)
    stopper.exit_now = lambda: leave(0, True)
    stopper.on_second.append(stopper.end_now_unless_writing)
    save_on_stop(worker, parking, stopper)
    return leave(0, worker.alive)
