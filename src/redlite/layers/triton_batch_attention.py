"""Decode attention of B sequences in one launch (CUDA; importable only where Triton is).

The batched counterpart of :func:`redlite.layers.triton_decode.decode_attention`: the same
kernel with a third grid axis over the sequences (``BATCHED``), each reading its own qkv row,
its own position and its own KV cache. The caches are separate tensors (one
:class:`~redlite.layers.kv_cache.KVCache` per slot, ``data`` ``[layers, 2, Hkv, max_tokens,
D]`` contiguous, all of one shape), so the kernel finds sequence b's cache through a table of
base addresses (row 0 of :func:`~redlite.models.slot_table.slot_table`); a layer's keys are
``layer * data.stride(0)`` elements past the base and its values ``data.stride(1)`` further. One launch per layer (plus the
split combine) replaces B launches of the single-sequence kernel and its combine.

Each row is computed exactly as the single-sequence kernel computes it alone with the same
number of key slices (same per-slice order, same combine), so the batched step stays
batch-invariant in attention when ``n_splits`` matches.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton

from redlite.layers import triton_decode as td
from redlite.models.slot_table import check_caches


def cache_bases(caches: Sequence, device: torch.device) -> torch.Tensor:
    """int64 ``[B]`` on ``device``: the address of each cache's ``data`` (a
    :class:`~redlite.layers.kv_cache.KVCache`); the batched step takes row 0 of
    :func:`~redlite.models.slot_table.slot_table` instead. Raises ``ValueError`` when the
    caches differ in shape or are not contiguous."""
    check_caches(caches)
    return torch.tensor([cache.data.data_ptr() for cache in caches], dtype=torch.int64).to(device)


def batch_splits(device: torch.device, n_kv_heads: int, batch: int, head_dim: int | None = None) -> int:
    """Key slices per (sequence, KV head): :func:`~redlite.layers.triton_decode.default_splits`
    spread over ``batch`` sequences (about ``splits_per_sm`` programs per multiprocessor in all)."""
    return td.default_splits(device, n_kv_heads * max(1, batch), head_dim)


def batch_decode_attention(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           norm_weight: torch.Tensor | None, eps: float, bases: torch.Tensor, like,
                           layer: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None,
                           n_splits: int, gated: bool = False,
                           k_norm_weight: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Attention of B tokens of B sequences: ``qkv`` [B, width] (row b as
    :func:`~redlite.layers.triton_decode.decode_attention` takes it, contiguous rows),
    ``pos`` LongTensor [B] (sequence b's position), ``bases`` the B caches' addresses
    (int64 [B] on the device: :func:`cache_bases`, or row 0 of a slot table), ``like`` one of those caches (shape and strides; every cache has them), ``layer``
    the cache layer index. Writes each token's k/v into its own cache at its position; returns
    [B, H, D] in qkv's dtype (``gated``: times sigmoid(gate), as the single-sequence kernel).
    Norms, rotary and windows as :func:`~redlite.layers.triton_decode.decode_attention`.
    ``config``: launch settings (``block_n``, ``num_warps``, ``num_stages``) overriding
    :func:`~redlite.layers.triton_decode.attn_config` (benchmarks)."""
    batch = qkv.shape[0]
    if pos.numel() != batch or bases.numel() != batch or not qkv.is_contiguous():
        raise ValueError(f"batched attention: qkv {tuple(qkv.shape)}, pos {pos.numel()}, bases {bases.numel()}")
    config = {**td.attn_config(head_dim), **(config or {})}
    group = n_heads // n_kv_heads
    data = like.data
    keys, values = like.keys[layer], like.values[layer]
    o_part = torch.empty(batch, n_splits, n_heads, head_dim, device=qkv.device, dtype=torch.float32)
    lse = torch.empty(batch, n_splits, n_heads, device=qkv.device, dtype=torch.float32)
    out = torch.empty(batch, n_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    block_s = triton.next_power_of_2(n_splits)
    knw = k_norm_weight if gated else (qkv if norm_weight is None else norm_weight[n_heads:])
    qs = (2 if gated else 1) * head_dim
    window = int(window or td.NO_WINDOW)
    td._decode_attention_kernel[(n_kv_heads, n_splits, batch)](
        qkv, pos, cos, sin, qkv if norm_weight is None else norm_weight, knw, keys, values, o_part, lse, lse,
        out, cos.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), window,
        td.LOG2E / math.sqrt(head_dim), float(eps), n_splits, H=n_heads, KV=n_kv_heads, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=config["block_n"], D=head_dim, R=cos.shape[-1],
        HAS_NORM=norm_weight is not None, IEEE=qkv.dtype == torch.float32, BLOCK_S=block_s, PDL=0,
        GATED=bool(gated), ZC=bool(gated), NW_ROWS=0 if gated else 1, QS=qs,
        DC=td.combine_chunk(n_splits, head_dim), COMBINE=False, base_ptr=bases, layer_off=layer * data.stride(0),
        v_off=data.stride(1), row_stride=qkv.stride(0), BATCHED=True,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    dc = min(head_dim, td.combine_chunk(n_splits, head_dim, 4096))
    td._combine_kernel[(n_heads, head_dim // dc, batch)](
        o_part, lse, qkv, pos, out, window, n_splits, H=n_heads, D=head_dim, QS=qs, GATED=bool(gated),
        BLOCK_S=block_s, DC=dc, BLOCK_N=config["block_n"], row_stride=qkv.stride(0), BATCHED=True, num_warps=4)
    return out
