"""One decode token for each of several sequences of one model in one forward pass.

:func:`forward_batch` is what :meth:`redlite.engine.torch_engine.TorchEngine.decode_batch`
runs: the B tokens go through every linear layer as one ``[B, in]`` product (the weights are
read once per step, not once per sequence: the bandwidth win of batching), while attention
runs per sequence over that sequence's own KV cache and length, and rotary positions are per
row. Each sequence's state is its own :class:`~redlite.models.base.ModelState` (no shared
cache); the Qwen3.5 hybrid's recurrent layers are in :mod:`redlite.models.qwen3_5_batch`.

Batch invariance (each row the same as that sequence decoded alone):

* Llama family with the fused CPU step (quantized GGUF weights on CPU, the bundled model):
  bitwise, through the C ``decode_batch`` (:meth:`FusedDecode.batch
  <redlite.layers.cpu_decode.FusedDecode.batch>`).
* quantized weights in the torch path: bitwise for the products (``rows_alone``, the C
  kernel computes each row as alone).
* dense weights (oneDNN/MKL on CPU, cuBLAS on CUDA): the ``[B, in]`` product may sum in
  another order than the ``[1, in]`` one, so logits agree to float rounding (about 1e-6
  relative in float32), and greedy tokens agree except at near-ties of the top logits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from redlite.engine.base import EngineError
from redlite.layers.attention import sdpa_backends
from redlite.layers.linear import embedding
from redlite.layers.norm import rms_norm
from redlite.layers.rotary import apply_rotary

import torch.nn.functional as F


def batch_linear(linear, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(x, weight, bias)`` for ``x`` [B, in] of B sequences: a quantized weight
    computes each row exactly as alone (its small-batch kernel whatever B); dense weights as
    ``linear`` does."""
    if isinstance(weight, torch.Tensor):
        return linear(x, weight, bias)
    return weight.linear(x, bias, rows_alone=True)


def supports_batch(model) -> bool:
    """Whether :func:`forward_batch` serves ``model`` (the Llama family, the Qwen3.5 hybrid)."""
    from redlite.models.llama import LlamaModel
    from redlite.models.qwen3_5 import Qwen3_5Model

    return isinstance(model, (LlamaModel, Qwen3_5Model))


def forward_batch(model, input_ids: Sequence[int], states: Sequence) -> torch.Tensor:
    """Feed ``input_ids[b]`` at ``states[b].n_past`` for B distinct states of ``model``; each
    ``n_past`` grows by 1. Returns float32 logits ``[B, vocab]``. Raises :class:`EngineError`
    (no state changed) when a state is full or a state appears twice. Runs under the caller's
    ``torch.inference_mode()``."""
    if len({id(s) for s in states}) != len(states):
        raise EngineError("forward_batch needs distinct states")
    for state in states:
        state.check_room(1)
    from redlite.models.llama import LlamaModel

    if isinstance(model, LlamaModel):
        fused = model._fused()
        logits = fused.batch(list(input_ids), list(states)) if fused is not None else \
            _llama_batch(model, input_ids, states)
    else:
        from redlite.models.qwen3_5_batch import qwen3_5_batch

        logits = qwen3_5_batch(model, input_ids, states)
    for state in states:
        state.n_past += 1
    return logits


def rotary_rows(rotary, positions: list[int], device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin ``[B, 1, rotary_dim]`` for one position per row (as
    :meth:`RotaryTable.get` gives them for each position alone)."""
    cos, sin = rotary.get(0, max(positions) + 1, device, dtype)
    index = torch.tensor(positions, device=cos.device)
    return cos.index_select(0, index), sin.index_select(0, index)


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Attention of one token's query heads ``q`` [H, D] over cache rows ``first .. end - 1``
    of ``keys``/``values`` [KV, max_tokens, D], as the single-sequence decode computes it
    (query heads of each kv head as "positions"). Returns [H, D]."""
    heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    with sdpa_backends(q.device):
        out = F.scaled_dot_product_attention(q.view(1, kv_heads, heads // kv_heads, head_dim),
                                             keys[None, :, first:end], values[None, :, first:end])
    return out.reshape(heads, head_dim)


def _llama_batch(model, input_ids: Sequence[int], states: Sequence) -> torch.Tensor:
    """The torch path of :func:`forward_batch` for a :class:`~redlite.models.llama.LlamaModel`
    (the same operations as its ``forward`` of one token, B rows at a time)."""
    spec = model.spec
    heads, kv_heads, head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
    positions = [int(s.n_past) for s in states]
    ids = torch.tensor(list(input_ids), dtype=torch.long, device=model.embed_weight.device)
    x = embedding(ids, model.embed_weight)
    cos, sin = rotary_rows(model.rotary, positions, x.device, x.dtype)
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        qkv = batch_linear(attn.linear, layer.input_norm(x), attn.qkv_weight, attn.qkv_bias)
        qk = qkv[:, :attn.qk_dim].unflatten(-1, (heads + kv_heads, head_dim))
        if attn.qk_norm_weight is not None:
            qk = rms_norm(qk, attn.qk_norm_weight, attn.norm_eps)
        qk = apply_rotary(qk, cos, sin)
        v = qkv[:, attn.qk_dim:].unflatten(-1, (kv_heads, head_dim))
        outs = []
        for b, (state, pos) in enumerate(zip(states, positions)):
            keys, values = state.cache.keys[i], state.cache.values[i]
            keys[:, pos].copy_(qk[b, heads:])
            values[:, pos].copy_(v[b])
            first = 0 if attn.window is None else max(0, pos + 1 - attn.window)
            outs.append(attend_one(qk[b, :heads], keys, values, first, pos + 1))
        out = torch.stack(outs).reshape(len(states), heads * head_dim)
        x.add_(batch_linear(attn.linear, out, attn.o_weight, attn.o_bias))
        x.add_(swiglu_batch(layer.mlp, layer.post_norm(x)))
    x = rms_norm(x, model.norm.weight, model.norm.eps)
    return batch_linear(model.linear, x, model.lm_head_weight, None).float()


def swiglu_batch(mlp, x: torch.Tensor) -> torch.Tensor:
    """:class:`~redlite.layers.mlp.SwiGLU` of ``x`` [B, hidden] through :func:`batch_linear`."""
    gate_up = batch_linear(mlp.linear, x, mlp.gate_up_weight, mlp.gate_up_bias)
    gate, up = gate_up.split(mlp.inter, dim=-1)
    return batch_linear(mlp.linear, F.silu(gate).mul_(up), mlp.down_weight, mlp.down_bias)
