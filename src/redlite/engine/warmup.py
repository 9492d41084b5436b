"""Start-up warm-up: the one-time costs of a GPU engine paid before the server reports ready.

On first use a CUDA engine compiles Triton kernels (decode kernels, flash-linear-attention's
autotuned prefill kernels), loads attention kernels and picks cuBLAS algorithms, and the graph
decoder captures its CUDA graphs. :func:`warm_up` does all of that at start-up, so the first
request runs as fast as the hundredth: prefills of the shapes the generator feeds (a full
chunk, a short odd-length one and one token, from an empty state and after held tokens), every
graph of every span bucket and sampling mode (:meth:`GraphDecoder.capture_all`) and of every
short-prefill chunk length (:class:`~redlite.engine.chunk_graphs.ChunkGraphs`), a token
stream per mode, a checkpoint round trip for states that cannot rewind, one chat render
(the tokenizer's template) and the tokenizer's table of token bytes (the reuse planner's, see
:mod:`redlite.core.same_bytes`). The engine is reset afterwards.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("redlite.warmup")

# On a GPU an eager prefill of up to ~64 tokens costs about the same (its kernel launches), so a
# checkpoint cut closer than this to another costs a pass on every such prefill and saves
# less than one pass on the rare restore at it (bench/results/short-prefill-2026-12-02-*.md).
GPU_CHECKPOINT_MIN_PIECE = 64


@dataclass
class WarmupReport:
    """seconds: wall time of the warm-up (0 when skipped). graphs: CUDA graphs the engine holds
    after it (decode and chunk graphs, those a warm-up prefill captured included).
    prefills: the prefill lengths run. skipped: why nothing was done (None when it ran).
    graph_prefill_tokens: the engine's measured ``graph_prefill_tokens`` (0: not set)."""

    seconds: float = 0.0
    graphs: int = 0
    prefills: tuple[int, ...] = ()
    skipped: str | None = None
    graph_prefill_tokens: int = 0


def warm_up(engine, tokenizer=None, prefill_chunk: int = 512, devices=("cuda",)) -> WarmupReport:
    """Warm ``engine`` up (see module docstring) and log the time it took. Only a torch engine
    on one of ``devices`` (device types; CUDA: the one with anything to warm) is warmed; others
    are left alone (``skipped`` says why). ``prefill_chunk``: the most tokens the generator
    prefills at once (``--prefill-chunk``). Raises what the engine raises (a model that cannot
    run is no server to start)."""
    device = getattr(engine, "device", None)
    if device is None or getattr(device, "type", None) not in devices:
        report = WarmupReport(skipped=f"nothing to warm up on {getattr(device, 'type', 'this engine')}")
        log.info("warm-up skipped: %s", report.skipped)
        return report
    import torch

    started = time.perf_counter()
    if tokenizer is not None and hasattr(tokenizer, "render_chat"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
    if callable(getattr(tokenizer, "token_bytes", None)):  # its table: read at the first fork
        tokenizer.token_bytes(0)
    report = WarmupReport()
    with torch.inference_mode():
        report.prefills = _prefills(engine, prefill_chunk)
        _graphs(engine)
        _streams(engine)
        report.graphs = _held_graphs(engine)  # with those a prefill shape captured on the way
        if report.graphs and device.type == "cuda":
            report.graph_prefill_tokens = _graph_prefill(engine)
            if not engine.can_rewind:
                engine.checkpoint_min_piece = GPU_CHECKPOINT_MIN_PIECE
        engine.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.seconds = time.perf_counter() - started
    log.info("warm-up done in %.2f s: %d CUDA graphs (decode path %s), prefill shapes %s, "
             "ready", report.seconds, report.graphs, engine.decode_path, list(report.prefills))
    return report


def _graph_prefill(engine, probe: int = 8, cap: int = 64) -> int:
    """With chunk graphs (:meth:`TorchEngine.chunk_graphs`), set ``graph_prefill_tokens`` to 1.
    Else measure an eager ``probe``-token prefill against ``probe`` graph decode steps (best of
    3, on a few held tokens) and set ``engine.graph_prefill_tokens`` to how many graph steps
    cost no more than the eager pass (at most ``cap``): on a GPU an eager pass of a few tokens
    is bound by its kernel launches, a replay is not. Returns it."""
    import torch

    chunks = engine.chunk_graphs()
    if chunks is not None:  # 2+ tokens replay a chunk graph; one token, the decode graph
        engine.graph_prefill_tokens = 1
        log.info("prefills of 2-%d tokens replay a captured graph per chunk length %s (%d graphs); one token, "
                 "the decode graph", chunks.buckets[-1], chunks.buckets, chunks.n_graphs)
        return 1
    ids = _ids(probe, engine.vocab_size)
    engine.graph_prefill_tokens = 0

    def best(run) -> float:
        times = []
        for _ in range(3):
            engine.reset()
            engine.prefill(ids[:3])
            torch.cuda.synchronize(engine.device)
            started = time.perf_counter()
            run()
            torch.cuda.synchronize(engine.device)
            times.append(time.perf_counter() - started)
        return min(times)

    eager = best(lambda: engine.prefill(ids))
    step = best(lambda: [engine.decode(token) for token in ids]) / probe
    engine.graph_prefill_tokens = max(1, min(cap, int(eager / step)))
    log.info("prefills of <= %d tokens run through the decode graph (an eager %d-token prefill "
             "took %.1f ms, a graph step %.2f ms)", engine.graph_prefill_tokens, probe, 1e3 * eager, 1e3 * step)
    return engine.graph_prefill_tokens


def _ids(n: int, vocab: int) -> list[int]:
    return [(7 * i + 3) % vocab for i in range(n)]


def _prefills(engine, chunk: int) -> tuple[int, ...]:
    """The generator's prefill shapes: a full chunk, 13 tokens, one token; from empty and on
    top of held tokens. Skips what does not fit the context."""
    chunk = max(1, min(chunk, engine.prefill_chunk, engine.max_context // 2))
    runs = []
    for lengths in ((13, chunk, 1), (chunk, 13)):
        engine.reset()
        logits = None
        for n in lengths:
            if engine.n_past + n + 2 <= engine.max_context:
                logits = engine.prefill(_ids(n, engine.vocab_size))
                runs.append(n)
        if logits is not None and not engine.can_rewind:  # the checkpoint copies
            engine.restore_checkpoint(engine.take_checkpoint(logits))
    return tuple(runs)


def _graphs(engine) -> int:
    """Capture ``engine``'s graphs (decoder and chunk graphs) at 3 held tokens; returns the
    graphs it holds then (see :func:`_held_graphs`)."""
    if engine.graph_decoder() is not None:
        engine.reset()
        engine.prefill(_ids(3, engine.vocab_size))
        engine.capture_graphs()
    return _held_graphs(engine)


def _held_graphs(engine) -> int:
    """CUDA graphs ``engine`` holds: its decoder's and its chunk graphs (0 without a decoder)."""
    decoder = engine.graph_decoder()
    if decoder is None:
        return 0
    chunks = engine.chunk_graphs()
    return decoder.n_graphs + (chunks.n_graphs if chunks is not None else 0)


def _streams(engine) -> None:
    """A token stream per sampling mode: the first-token sampling outside the graphs, the
    host read-back, and an undo."""
    from redlite.engine.base import SamplingParams

    for params in (SamplingParams(temperature=0.0), SamplingParams(seed=0, top_p=0.9, top_k=50)):
        engine.reset()
        logits = engine.prefill(_ids(5, engine.vocab_size))
        stream = engine.token_stream(params, logits)
        if stream is None:
            return
        for _ in range(2):
            stream.feed()
            stream.read()
        stream.undo()


def warm_up_slots(engines, devices=("cuda",)) -> float:
    """Warm a pool of slots up (``engines``: the pool's engine first, then its slots): each
    slot's own graph decoder captured, and one batched decode step of every batch size from 2
    to ``len(engines)``, plus one fed from device picks (batch sizes change the batched
    attention's key slicing, so each size may compile its own kernels; with graphs per batch
    size these steps capture them). Every slot is reset afterwards. Returns the seconds it
    took (0 when the pool is not on one of ``devices``)."""
    device = getattr(engines[0], "device", None)
    if len(engines) < 2 or getattr(device, "type", None) not in devices:
        return 0.0
    import torch

    from redlite.engine.picks import PICKED

    started = time.perf_counter()
    pool = engines[0]
    with torch.inference_mode():
        graphs = sum(_graphs(slot) for slot in engines[1:])
        for slot in engines:
            slot.reset()
            slot.prefill(_ids(3, pool.vocab_size))
        for size in range(2, len(engines) + 1):
            rows = pool.decode_batch(engines[:size], _ids(size, pool.vocab_size))
        pool.greedy_batch_async(engines, rows)
        pool.decode_batch(engines, [PICKED] * len(engines))
        for slot in engines:
            slot.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    batched = getattr(pool, "_shared", {}).get("batch_graphs")
    log.info("slot warm-up done in %.2f s: %d slots, %d CUDA graphs of their own, batched steps of 2-%d "
             "(%d batched graphs)", seconds, len(engines), graphs, len(engines), getattr(batched, "n_graphs", 0))
    return seconds
