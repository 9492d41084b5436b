"""Address tables of B sequence states for the batched decode kernels.

A batched step reads each sequence's KV cache (and, for the Qwen3.5 hybrid, its flat conv and
recurrent buffers) through a table of device addresses instead of through B tensor arguments.
The kernels then depend on the batch size only, not on which states fill it, so one captured
CUDA graph per batch size serves every set of slots: the table is refilled before each replay
(:class:`~redlite.engine.batch_graphs.BatchGraphs`). Row ``r`` of the table is every state's
``buffer_addresses()[r]`` (row 0 the KV caches' ``data``; rows 1 and 2 the hybrid's flat conv
and recurrent buffers).
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_caches(caches: Sequence) -> None:
    """Raise ``ValueError`` unless the :class:`~redlite.layers.kv_cache.KVCache` objects
    ``caches`` share one shape and are contiguous (the batched kernels address every cache
    with the first one's strides)."""
    first = caches[0].data
    for cache in caches:
        if cache.data.shape != first.shape or not cache.data.is_contiguous():
            raise ValueError("batched attention needs contiguous caches of one shape")


def table_rows(states: Sequence) -> list[list[int]]:
    """The table's rows as host ints: ``rows[r][b] = states[b].buffer_addresses()[r]``.
    Raises ``ValueError`` as :func:`check_caches`."""
    check_caches([state.cache for state in states])
    return [list(row) for row in zip(*(state.buffer_addresses() for state in states))]


def slot_table(states: Sequence, device: torch.device, memo: dict | None = None) -> torch.Tensor:
    """int64 ``[R, B]`` on ``device``: :func:`table_rows` of ``states``. ``memo``: a dict kept
    between calls, keyed by the addresses (a table is a function of them), so repeated steps
    of one set of states copy nothing to the device."""
    rows = table_rows(states)
    key = tuple(map(tuple, rows))
    if memo is not None and key in memo:
        return memo[key]
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    if memo is not None:
        if len(memo) >= 64:
            memo.pop(next(iter(memo)))
        memo[key] = table
    return table
