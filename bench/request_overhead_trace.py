"""The server side of bench/request_overhead.py: ``redlite serve`` with timing wrappers.

``python bench/request_overhead_trace.py TRACE serve ...`` wraps the stages listed in
:data:`STAGES` (the library code is unchanged) and runs the CLI; per chat request one JSON line
is appended to TRACE: for each stage a list of ``[start, end, thread CPU s]`` stamps
(``time.perf_counter``, CLOCK_MONOTONIC: the client's clock too), and points in time (``recv``,
``body``, ``sse``, ``event_*``) whose third field is the process's CPU time then.

With ``--profile FILE`` before TRACE, the stages in :data:`PROFILED` also run under one
:mod:`cProfile` profile (enabled on the thread running the stage), written to FILE
(``pstats`` format) every 10 requests; the first request (a cold render and prefill) is left
out.
"""

from __future__ import annotations

import json
import sys
import threading
import time

# (label, where, attribute): the stages timed in the server (see _install); "a|b": a where
# the server's sources have it, else b
STAGES = [
    ("validate", "redlite.server.schemas:ChatCompletionRequest", "model_validate_json"),
    ("chat_request_of", "redlite.server.app", "chat_request_of"),
    ("prepare", "redlite.server.chat_service:ChatService", "prepare_sync"),
    ("min_tokens", "redlite.server.chat_service", "min_chat_tokens"),
    ("replay_find", "redlite.core.replay:ReplayStore", "find"),
    ("jinja", "redlite.loading.chat_template:ChatTemplate", "render"),
    ("protect", "redlite.loading.plain_specials:PlainSpecials", "protect"),
    ("tokenize", "redlite.loading.segment_encoder:SegmentEncoder", "encode_pieces|encode"),
    ("message_ends", "redlite.loading.tokenizer", "message_boundaries"),
    ("submit", "redlite.server.jobs", "queue"),
    ("job", "redlite.core.worker", "run_job"),
    ("plan", "redlite.core.generation:Generator", "plan"),
    ("select", "redlite.core.conversations:Conversations", "select"),
    ("execute", "redlite.core.generation:Generator", "_execute"),
    ("park", "redlite.core.conversations:Conversations", "before_cut"),
    ("prefill", "redlite.engine.torch_engine:TorchEngine", "prefill"),
    ("rewind", "redlite.engine.torch_engine:TorchEngine", "rewind"),
    ("restore", "redlite.engine.torch_checkpoints:TorchCheckpoints", "restore_checkpoint"),
    ("checkpoint", "redlite.engine.torch_checkpoints:TorchCheckpoints", "take_checkpoint"),
    ("checkpoint_add", "redlite.core.checkpoints:CheckpointStore", "add"),
    ("split_points", "redlite.core.generation", "prefill_split_points"),
    ("sample", "redlite.core.token_loop:HostLoop", "next"),
    ("sample", "redlite.core.token_loop:StreamLoop", "next"),  # device sampling (CUDA): one of the two
    ("settle", "redlite.core.parker:Parker", "settle"),
    # finer stamps, kept in the trace (--keep-trace) for a closer look, not in the table
    ("park_live", "redlite.core.parker:Parker", "park_live"),
    ("snapshot_range", "redlite.engine.torch_ranges:TorchRanges", "snapshot_range"),
    ("export_recurrent", "redlite.models.qwen3_5_state:Qwen3_5State", "export_recurrent"),
    ("token_loop", "redlite.core.generation:Generator", "_token_loop"),
    ("token_stream", "redlite.engine.torch_graphs:TorchGraphs", "token_stream"),
    ("sampling_set", "redlite.engine.device_sampling:DeviceSampling", "set"),
    ("sample_first", "redlite.engine.cuda_graphs:GraphDecoder", "sample_first"),
    ("incremental_decoder", "redlite.loading.tokenizer:HFTokenizer", "incremental_decoder"),
    ("record_turn", "redlite.server.chat_service", "record_turn"),
]
ENGINE = ("prefill", "rewind", "sample")
PROFILED = ("prepare", "select", "plan", "execute")


class _Trace:
    """The stamps of the request being served (the benchmark sends one at a time)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", encoding="utf-8")
        self.current: dict | None = None
        self.lock = threading.Lock()

    def add(self, label: str, t0: float, t1: float | None, cpu: float) -> list:
        """A stamp [start, end, thread CPU s]; a stage still running leaves end None."""
        stamp = [t0, t1, cpu]
        with self.lock:
            if self.current is not None:
                self.current.setdefault(label, []).append(stamp)
        return stamp

    def mark(self, label: str) -> None:
        """A point in time; its third field is the process's CPU time (all threads) then."""
        t = time.perf_counter()
        self.add(label, t, t, time.process_time())

    def flush(self, record: dict) -> None:
        """Write ``record`` (a request's stamps; the next request may have started)."""
        with self.lock:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.current is record:
                self.current = None


def _timed(trace: _Trace, label: str, fn, profile=None):
    def wrapper(*args, **kwargs):
        c0 = time.thread_time()
        stamp = trace.add(label, time.perf_counter(), None, 0.0)
        if profile is not None:
            profile.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            if profile is not None:
                profile.disable()
            stamp[1], stamp[2] = time.perf_counter(), time.thread_time() - c0
    return wrapper


def _install(trace: _Trace, profile_path: str | None = None) -> None:
    import importlib

    import redlite.server.run as run
    from redlite.server import jobs

    profile = None
    if profile_path:
        import cProfile
        profile = cProfile.Profile()
    for label, where, name in STAGES:
        module, _, cls = where.partition(":")
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        name = next(n for n in name.split("|") if hasattr(owner, n))  # the first one it has
        original = getattr(owner, name)
        wrapped = _timed(trace, label, original, profile if label in PROFILED else None)
        setattr(owner, name, staticmethod(wrapped) if cls and isinstance(
            owner.__dict__.get(name), (classmethod, staticmethod)) or label == "validate" else wrapped)

    note = jobs.note_event

    def note_event(scope, event):  # on the worker thread, as each event is handed over
        if event.kind in ("started", "output"):
            trace.mark("event_" + event.kind)
        return note(scope, event)
    jobs.note_event = note_event

    create = run.create_app
    served = [0]

    def create_app(state):
        app = create(state)

        async def timed_app(scope, receive, send):
            if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
                return await app(scope, receive, send)
            record = trace.current = {"recv": [(time.perf_counter(),) * 2 + (time.process_time(),)]}

            async def receive_timed():
                message = await receive()
                if message["type"] == "http.request" and not message.get("more_body"):
                    trace.mark("body")
                return message

            async def send_timed(message):
                if message["type"] == "http.response.body" and message.get("body"):
                    trace.mark("sse")  # the first is the role chunk, the second the first token's
                await send(message)
            try:
                await app(scope, receive_timed, send_timed)
            finally:
                trace.flush(record)
                served[0] += 1
                if profile is not None and served[0] == 1:
                    profile.clear()  # the first (cold) request's render and prefill left out
                if profile is not None and served[0] % 10 == 0:
                    profile.dump_stats(profile_path)
        return timed_app
    run.create_app = create_app


def child(trace_path: str, argv: list[str], profile_path: str | None = None) -> int:
    _install(_Trace(trace_path), profile_path)
    from redlite.cli import main
    return main(argv)



if __name__ == "__main__":
    if sys.argv[1] == "--profile":
        raise SystemExit(child(sys.argv[3], sys.argv[4:], sys.argv[2]))
    raise SystemExit(child(sys.argv[1], sys.argv[2:]))
