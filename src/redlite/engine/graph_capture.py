"""Capture one CUDA graph so that a failed capture leaves the process as it was.

``torch.cuda.graph`` leaves two things behind when the captured code fails (a host read, a
kernel that refuses capture): the default CUDA generator stays in its capture mode, so every
later random op on the device raises ("Offset increment outside graph capture"), and the
capture stream stays current. :func:`capture_graph` captures with a private copy of the
generator's state registered with the graph (the caller's generator is never touched) and
always ends the capture and restores the stream, so a caller can fall back and carry on.

The graph's own random ops, if any, draw from that private state on replay: a stream of
their own, not the default generator's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture_graph(fn: Callable[[], Any], device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``fn()`` (already warmed up: no first-call compilation or allocation that
    cannot be captured) on a side stream of ``device``, memory from ``pool`` (a
    ``torch.cuda.graph_pool_handle()``, or None for a private one). Returns the graph and
    what ``fn`` returned (its tensors are the graph's static outputs). Raises what ``fn`` or
    the capture raised; the default generator, the current stream and the caching allocator
    are as before either way."""
    device = torch.device(device)
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    own_state = generator.graphsafe_get_state()
    generator.graphsafe_set_state(generator.clone_state())  # the state the graph registers
    torch.cuda.synchronize(device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    try:
        with torch.cuda.stream(stream):
            # thread_local: lane threads waiting on events of earlier steps do not void the capture
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                _end_failed(graph)
                raise
            graph.capture_end()
    finally:
        generator.graphsafe_set_state(own_state)
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, out


def _end_failed(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture whose body failed (the capture is invalid; ending it raises)."""
    try:
        graph.capture_end()
    except RuntimeError:
        pass
    torch.cuda.synchronize()
