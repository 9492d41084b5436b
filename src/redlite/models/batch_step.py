"""The graph-capturable decode step of B sequences at once (the batched counterpart of the
models' ``decode_step``; replayed by :class:`redlite.engine.batch_graphs.BatchGraphs`).

Tokens and positions are device tensors ``[B]`` (no host reads, no allocation that depends
on a position). With the Triton ops the per-sequence kernels find each sequence's KV cache
and recurrent states through an address table (:mod:`redlite.models.slot_table`), so one
captured CUDA graph serves every set of B states; the torch ops take the states' tensors, so
a graph of theirs serves one set. The products of all B rows are one ``[B, in]`` matrix
product each (cuBLAS on CUDA: the weights are read once per step); the work that belongs to
one sequence runs per row through the decode ops (:mod:`redlite.layers.decode_ops`): q/k
norm, rotary, the KV write and attention over that sequence's own cache
(``batch_rope_attend``), and for the Qwen3.5 hybrid the Gated DeltaNet step over its own conv
and recurrent states (``batch_gdn_step``) and mixture-of-experts routing (``moe``). With ops
whose ``batch_invariant`` is set, the step is the lone ``decode_step``'s ops on B rows (both
families), each row bitwise what that sequence's step alone gives.
"""

from __future__ import annotations

from typing import Sequence

import torch

from redlite.layers.linear import embedding
from redlite.layers.norm import zero_centered_rms_norm
from redlite.models.batch_decode import batch_linear, swiglu_batch
from redlite.models.qwen3_5 import mlp_residual
from redlite.models.qwen3_5_config import LINEAR


def batch_decode_step(model, tokens: torch.Tensor, pos: torch.Tensor, states: Sequence, span: int,
                      ops, table: torch.Tensor | None = None) -> torch.Tensor:
    """Feed ``tokens[b]`` (LongTensor [B] on the model's device) at ``pos[b]`` (LongTensor
    [B], sequence b's ``n_past``) of ``states[b]`` (B distinct states of ``model``, all with
    the same ``max_tokens``). ``span``: cache rows the torch ops may read (``> max(pos)``;
    ignored by ops with ``length_from_pos``). ``table``: the states' address table
    (``ops.slot_table(states)``, the default; a graph passes its static copy, refilled before
    each replay). Writes each token's keys/values (and, for the hybrid, updates the
    conv/recurrent states in place); ``n_past`` is left to the caller. Returns float32 logits
    ``[B, vocab]``."""
    from redlite.models.llama import LlamaModel

    table = ops.slot_table(states) if table is None else table
    if isinstance(model, LlamaModel):
        return _llama_step(model, tokens, pos, states, span, ops, table)
    return _qwen3_5_step(model, tokens, pos, states, span, ops, table)


def _llama_step(model, tokens, pos, states, span, ops, table) -> torch.Tensor:
    x = embedding(tokens, model.embed_weight)  # [B, hidden], updated in place
    cos, sin = model.rotary.get(0, states[0].max_tokens, x.device, x.dtype)
    caches = [state.cache for state in states]
    layers = model.layers
    if getattr(ops, "batch_invariant", False):  # the lone decode_step's ops, on B rows
        for i, layer in enumerate(layers):
            attn, mlp = layer.attn, layer.mlp
            qkv = ops.norm_linear(x, layer.input_norm.weight, layer.input_norm.eps, attn.qkv_weight, attn.qkv_bias)
            out = ops.batch_rope_attend(qkv, pos, cos, sin, attn.qk_norm_weight, attn.norm_eps, caches, i,
                                        attn.n_heads, attn.n_kv_heads, attn.head_dim, span, attn.window,
                                        table=table)
            ops.linear_residual(out, attn.o_weight, attn.o_bias, x)
            act = ops.norm_gate_up(x, layer.post_norm.weight, layer.post_norm.eps, mlp.gate_up_weight,
                                   mlp.gate_up_bias, mlp.inter)
            ops.linear_residual(act, mlp.down_weight, mlp.down_bias, x)
        return ops.norm_linear(x, model.norm.weight, model.norm.eps, model.lm_head_weight, None, out_float32=True)
    h = ops.rms_norm(x, layers[0].input_norm.weight, layers[0].input_norm.eps)
    for i, layer in enumerate(layers):
        attn, mlp, post = layer.attn, layer.mlp, layer.post_norm
        qkv = batch_linear(attn.linear, h, attn.qkv_weight, attn.qkv_bias)
        out = ops.batch_rope_attend(qkv, pos, cos, sin, attn.qk_norm_weight, attn.norm_eps, caches, i, attn.n_heads,
                                    attn.n_kv_heads, attn.head_dim, span, attn.window, table=table)
        h = ops.add_rms_norm(x, batch_linear(attn.linear, out, attn.o_weight, attn.o_bias), post.weight, post.eps)
        act = ops.silu_mul(batch_linear(mlp.linear, h, mlp.gate_up_weight, mlp.gate_up_bias), mlp.inter)
        norm = layers[i + 1].input_norm if i + 1 < len(layers) else model.norm
        h = ops.add_rms_norm(x, batch_linear(mlp.linear, act, mlp.down_weight, mlp.down_bias), norm.weight, norm.eps)
    return batch_linear(model.linear, h, model.lm_head_weight, None).float()


def _qwen3_5_step(model, tokens, pos, states, span, ops, table) -> torch.Tensor:
    if getattr(ops, "batch_invariant", False):
        return _qwen3_5_invariant_step(model, tokens, pos, states, span, ops, table)
    x = torch.nn.functional.embedding(tokens, model.embed_weight)
    cos, sin = model.rotary.get(0, states[0].max_tokens, x.device, x.dtype)
    for i, layer in enumerate(model.layers):
        norm = layer.input_layernorm
        h = zero_centered_rms_norm(x, norm.weight, norm.eps)
        if layer.layer_type == LINEAR:
            mixer = layer.linear_attn
            out = ops.batch_gdn_step(batch_linear(mixer.linear, h, mixer.in_proj_weight, None), states, i, mixer, table)
            x.add_(batch_linear(mixer.linear, out, mixer.out_weight, None))
        else:
            attn = layer.self_attn
            qkv = batch_linear(attn.linear, h, attn.qkv_weight, attn.qkv_bias)
            out = _gated_attend(ops, qkv, pos, cos, sin, states, i, attn, span, table)
            x.add_(batch_linear(attn.linear, out, attn.o_weight, attn.o_bias))
        post, mlp = layer.post_attention_layernorm, layer.mlp
        if layer.moe:
            _moe_rows(ops, x, post, mlp)
            continue
        x.add_(swiglu_batch(mlp, zero_centered_rms_norm(x, post.weight, post.eps)))
    x = zero_centered_rms_norm(x, model.norm.weight, model.norm.eps)
    return batch_linear(model.linear, x, model.lm_head_weight, None).float()


def _qwen3_5_invariant_step(model, tokens, pos, states, span, ops, table) -> torch.Tensor:
    """The hybrid's lone ``decode_step`` ops on B rows (norm + product kernels on ``[B, K]``,
    each row computed as alone; attention sliced as alone; GDN and MoE per row)."""
    x = torch.nn.functional.embedding(tokens, model.embed_weight)  # [B, hidden], updated in place
    cos, sin = model.rotary.get(0, states[0].max_tokens, x.device, x.dtype)
    for i, layer in enumerate(model.layers):
        norm = layer.input_layernorm
        if layer.layer_type == LINEAR:
            mixer = layer.linear_attn
            proj = ops.norm_linear(x, norm.weight, norm.eps, mixer.in_proj_weight, None, zero_centered=True)
            ops.linear_residual(ops.batch_gdn_step(proj, states, i, mixer, table), mixer.out_weight, None, x)
        else:
            attn = layer.self_attn
            qkv = ops.norm_linear(x, norm.weight, norm.eps, attn.qkv_weight, attn.qkv_bias, zero_centered=True)
            out = _gated_attend(ops, qkv, pos, cos, sin, states, i, attn, span, table)
            ops.linear_residual(out, attn.o_weight, attn.o_bias, x)
        mlp_residual(ops, x, layer, _moe_rows)
    return ops.norm_linear(x, model.norm.weight, model.norm.eps, model.lm_head_weight, None, out_float32=True,
                           zero_centered=True)


def _gated_attend(ops, qkv, pos, cos, sin, states, i, attn, span, table) -> torch.Tensor:
    """Layer ``i``'s gated attention of each row over its own cache: [B, H * D]."""
    return ops.batch_rope_attend(qkv, pos, cos, sin, attn.q_norm_weight, attn.eps, [state.cache for state in states],
                                 states[0].kv_slot[i], attn.n_heads, attn.n_kv_heads, attn.head_dim, span, None,
                                 gated=True, k_norm=attn.k_norm_weight, table=table)


def _moe_rows(ops, x, post, mlp) -> None:
    """``x[b] += moe(norm(x[b]))`` per row: routing per token, through the single-token path."""
    for b in range(x.shape[0]):
        ops.moe(x[b:b + 1], post.weight, post.eps, mlp, zero_centered=True)
