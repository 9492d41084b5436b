"""The graph-capturable prefill of a short chunk of T tokens of one sequence, Qwen3.5 hybrid
family (dense MLP): the counterpart of :func:`redlite.models.chunk_step.chunk_prefill_step`
(same contract, same :class:`~redlite.engine.chunk_graphs.ChunkGraphs`).

A chunk may be padded past its real tokens (row ``last`` is the last real one). The full
attention layers write the padded rows' keys/values past ``n_past``, free space as in the
Llama family; the Gated DeltaNet layers must not take the padding into their states: their
conv state keeps the inputs up to row ``last`` and the padded rows get no write and no decay
(:meth:`~redlite.layers.gated_deltanet.GatedDeltaNet.mix` with ``last``), so the states end as
after the real tokens alone.
"""

from __future__ import annotations

import torch

from redlite.layers.linear import embedding
from redlite.layers.norm import zero_centered_rms_norm
from redlite.models.batch_decode import batch_linear
from redlite.models.qwen3_5_config import LINEAR


def supports_hybrid_chunk(model) -> bool:
    """Whether :func:`hybrid_chunk_prefill_step` serves ``model``: a Qwen3.5 model whose
    layers all have a dense MLP (the mixture-of-experts MLP has no T-row step here)."""
    from redlite.models.qwen3_5 import Qwen3_5Model

    return isinstance(model, Qwen3_5Model) and not any(layer.moe for layer in model.layers)


def hybrid_chunk_prefill_step(model, tokens: torch.Tensor, pos: torch.Tensor, last: torch.Tensor, state,
                              span: int, ops) -> torch.Tensor:
    """Feed ``tokens`` (LongTensor [T]) at positions ``pos .. pos + T - 1`` (``pos``:
    LongTensor [1], the state's ``n_past``) of ``state``, a
    :class:`~redlite.models.qwen3_5_state.Qwen3_5State`; ``last``: LongTensor [1], the last
    real row (rows after it are padding; its logits are returned). ``span``: cache rows the
    attention reads (``>= pos + T``). Updates the conv/recurrent states in place as the real
    rows alone would and writes the T rows' keys/values; ``n_past`` is left to the caller.
    The delta rule runs as :meth:`~redlite.layers.gated_deltanet.GatedDeltaNet.mix` picks it
    (flash-linear-attention on CUDA where installed, the torch form else). Returns float32
    logits ``[1, vocab]``."""
    x = embedding(tokens, model.embed_weight)
    cos, sin = model.rotary.get(0, state.max_tokens, x.device, x.dtype)
    keys, values = state.cache.keys, state.cache.values
    for i, layer in enumerate(model.layers):
        norm = layer.input_layernorm
        h = zero_centered_rms_norm(x, norm.weight, norm.eps)
        if layer.layer_type == LINEAR:
            mixer = layer.linear_attn
            proj = batch_linear(mixer.linear, h, mixer.in_proj_weight, None)
            out = mixer.mix(proj, state.conv[i], state.recurrent[i], last=last)
            x = x + batch_linear(mixer.linear, out, mixer.out_weight, None)
        else:
            attn, slot = layer.self_attn, state.kv_slot[i]
            qkv = batch_linear(attn.linear, h, attn.qkv_weight, attn.qkv_bias)
            out = ops.chunk_gated_rope_attend(qkv, pos, cos, sin, attn.q_norm_weight, attn.k_norm_weight,
                                              attn.eps, keys[slot], values[slot], attn.n_heads,
                                              attn.n_kv_heads, attn.head_dim, span)
            x = x + batch_linear(attn.linear, out, attn.o_weight, attn.o_bias)
        post, mlp = layer.post_attention_layernorm, layer.mlp
        h = zero_centered_rms_norm(x, post.weight, post.eps)
        act = ops.silu_mul(batch_linear(mlp.linear, h, mlp.gate_up_weight, mlp.gate_up_bias), mlp.inter)
        x = x + batch_linear(mlp.linear, act, mlp.down_weight, mlp.down_bias)
    h = zero_centered_rms_norm(x.index_select(0, last), model.norm.weight, model.norm.eps)
    return batch_linear(model.linear, h, model.lm_head_weight, None).float()
