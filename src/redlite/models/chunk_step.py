"""The graph-capturable prefill of a short chunk of T tokens of one sequence (the Llama family;
the Qwen3.5 hybrid's is :mod:`redlite.models.qwen3_5_chunk`):
the T tokens at positions ``pos .. pos + T - 1`` with ``pos`` a device tensor, so one CUDA graph
per chunk length serves every position (:class:`redlite.engine.chunk_graphs.ChunkGraphs`).

On a GPU an eager prefill of a few tokens is bound by its kernel launches; replayed as a graph
it costs about what its weight and KV reads cost (bench/results/serve_gpu-*). The
products are ``[T, in]`` matrix products (as the eager prefill's), attention is the decode ops'
``chunk_rope_attend`` (every k/v row written before any is read), and only the logits of row
``last`` (a device index: the chunk may be padded past its real tokens) are computed.
"""

from __future__ import annotations

import torch

from redlite.layers.linear import embedding
from redlite.models.batch_decode import batch_linear


def supports_chunk(model) -> bool:
    """Whether :func:`chunk_prefill_step` serves ``model``: the Llama family, and the Qwen3.5
    hybrid with dense MLPs (:mod:`redlite.models.qwen3_5_chunk`)."""
    from redlite.models.llama import LlamaModel
    from redlite.models.qwen3_5_chunk import supports_hybrid_chunk

    return isinstance(model, LlamaModel) or supports_hybrid_chunk(model)


def longest_chunk(model) -> int:
    """The most tokens one chunk of ``model`` takes: 64, or for the hybrid the longest piece
    its Gated DeltaNet runs through the one-launch recurrent kernel (``recurrent_max_tokens``)."""
    from redlite.models.llama import LlamaModel

    if isinstance(model, LlamaModel):
        return 64
    from redlite.layers.gated_deltanet import GatedDeltaNet

    return GatedDeltaNet.recurrent_max_tokens


def chunk_prefill_step(model, tokens: torch.Tensor, pos: torch.Tensor, last: torch.Tensor, state, span: int,
                       ops) -> torch.Tensor:
    """Feed ``tokens`` (LongTensor [T] on the model's device) at positions ``pos .. pos + T - 1``
    (``pos``: LongTensor [1], the state's ``n_past``; ``pos + T <= state.max_tokens``) of
    ``state``, a :class:`~redlite.models.llama.LlamaState`. ``last``: LongTensor [1], the row
    whose logits are returned. ``span``: cache rows the torch ops read (``>= pos + T``;
    ignored by ops with ``length_from_pos``). Writes the T tokens' keys/values (rows past the
    real tokens of a padded chunk are written too, past ``n_past``); ``n_past`` is left to the
    caller. Returns float32 logits ``[1, vocab]``. A Qwen3.5 model goes to
    :func:`~redlite.models.qwen3_5_chunk.hybrid_chunk_prefill_step` (same contract; ``last``
    is also the last real row, padding stays out of the recurrent states)."""
    from redlite.models.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        from redlite.models.qwen3_5_chunk import hybrid_chunk_prefill_step

        return hybrid_chunk_prefill_step(model, tokens, pos, last, state, span, ops)
    x = embedding(tokens, model.embed_weight)  # [T, hidden], updated in place
    cos, sin = model.rotary.get(0, state.max_tokens, x.device, x.dtype)
    keys, values = state.cache.keys, state.cache.values
    layers = model.layers
    h = ops.rms_norm(x, layers[0].input_norm.weight, layers[0].input_norm.eps)
    for i, layer in enumerate(layers):
        attn, mlp, post = layer.attn, layer.mlp, layer.post_norm
        qkv = batch_linear(attn.linear, h, attn.qkv_weight, attn.qkv_bias)
        out = ops.chunk_rope_attend(qkv, pos, cos, sin, attn.qk_norm_weight, attn.norm_eps, keys[i], values[i],
                                    attn.n_heads, attn.n_kv_heads, attn.head_dim, span, attn.window)
        h = ops.add_rms_norm(x, batch_linear(attn.linear, out, attn.o_weight, attn.o_bias), post.weight, post.eps)
        act = ops.silu_mul(batch_linear(mlp.linear, h, mlp.gate_up_weight, mlp.gate_up_bias), mlp.inter)
        norm = layers[i + 1].input_norm if i + 1 < len(layers) else model.norm
        h = ops.add_rms_norm(x, batch_linear(mlp.linear, act, mlp.down_weight, mlp.down_bias), norm.weight, norm.eps)
    return batch_linear(model.linear, h.index_select(0, last), model.lm_head_weight, None).float()
