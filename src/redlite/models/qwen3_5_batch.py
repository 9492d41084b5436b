"""One decode token for each of several sequences of a Qwen3.5 hybrid model in one pass (the
hybrid part of :func:`redlite.models.batch_decode.forward_batch`).

Linear layers take the B rows at once; full attention runs per sequence over its own KV
cache; the Gated DeltaNet layers gather the sequences' conv and recurrent states (each state
keeps its own tensors), run one batched convolution step and one batched gated delta rule
step (the B sequences' value heads side by side: the delta rule is independent per head), and
write the new states back. Each operation is the single-sequence one applied per row.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from redlite.layers.delta_rule import l2_normalize, recurrent_gated_delta_rule
from redlite.layers.gated_deltanet import _fla_funcs, fla_available
from redlite.layers.norm import zero_centered_rms_norm
from redlite.layers.rotary import apply_rotary
from redlite.models.batch_decode import attend_one, batch_linear, rotary_rows, swiglu_batch
from redlite.models.qwen3_5_config import LINEAR


def qwen3_5_batch(model, input_ids: Sequence[int], states: Sequence) -> torch.Tensor:
    """Logits float32 ``[B, vocab]`` of ``input_ids[b]`` fed at ``states[b].n_past`` (B
    distinct :class:`~redlite.models.qwen3_5_state.Qwen3_5State` with room checked by the
    caller); the states are updated but their ``n_past`` is left to the caller."""
    positions = [int(s.n_past) for s in states]
    ids = torch.tensor(list(input_ids), dtype=torch.long, device=model.embed_weight.device)
    x = F.embedding(ids, model.embed_weight)
    cos = sin = None
    if states[0].kv_slot:
        cos, sin = rotary_rows(model.rotary, positions, x.device, x.dtype)
    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        if layer.layer_type == LINEAR:
            mixer = layer.linear_attn
            proj = batch_linear(mixer.linear, h, mixer.in_proj_weight, None)
            mixed = gdn_mix_batch(mixer, proj, [s.conv[i] for s in states], [s.recurrent[i] for s in states])
            h = batch_linear(mixer.linear, mixed, mixer.out_weight, None)
        else:
            h = _gated_attention(layer.self_attn, h, positions, cos, sin, states, states[0].kv_slot[i])
        x = x + h
        post = layer.post_attention_layernorm(x)
        x = x + (layer.mlp(post) if layer.moe else swiglu_batch(layer.mlp, post))
    return batch_linear(model.linear, model.norm(x), model.lm_head_weight, None).float()


def _gated_attention(attn, x: torch.Tensor, positions: list[int], cos, sin, states, slot: int) -> torch.Tensor:
    """:class:`~redlite.layers.gated_attention.GatedAttention` of one token per sequence
    (``x`` [B, hidden]); writes each token's k/v into its own cache. Returns [B, hidden]."""
    n = x.shape[0]
    h, hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = batch_linear(attn.linear, x, attn.qkv_weight, attn.qkv_bias)
    q, gate = qkv[:, :attn.q_rows].view(n, h, 2 * d).split(d, dim=-1)
    k = qkv[:, attn.q_rows:attn.q_rows + attn.kv_rows].view(n, hkv, d)
    v = qkv[:, attn.q_rows + attn.kv_rows:].view(n, hkv, d)
    q = apply_rotary(zero_centered_rms_norm(q, attn.q_norm_weight, attn.eps), cos, sin)
    k = apply_rotary(zero_centered_rms_norm(k, attn.k_norm_weight, attn.eps), cos, sin)
    outs = []
    for b, (state, pos) in enumerate(zip(states, positions)):
        keys, values = state.cache.keys[slot], state.cache.values[slot]
        keys[:, pos].copy_(k[b])
        values[:, pos].copy_(v[b])
        outs.append(attend_one(q[b], keys, values, 0, pos + 1))
    out = torch.stack(outs).reshape(n, h * d) * torch.sigmoid(gate.reshape(n, h * d))
    return batch_linear(attn.linear, out, attn.o_weight, attn.o_bias)


def gdn_mix_batch(mixer, proj: torch.Tensor, conv_states: list[torch.Tensor],
                  recurrent_states: list[torch.Tensor]) -> torch.Tensor:
    """:meth:`GatedDeltaNet.mix <redlite.layers.gated_deltanet.GatedDeltaNet.mix>` of one
    token for each of B sequences: ``proj`` [B, C + Hv*Dv + 2*Hv]; ``conv_states[b]``
    [C, K - 1] and ``recurrent_states[b]`` [Hv, Dk, Dv] (float32) are sequence b's, updated
    in place. Returns [B, Hv*Dv] in proj's dtype."""
    n = proj.shape[0]
    hk, hv, dk, dv = mixer.num_key_heads, mixer.num_value_heads, mixer.key_head_dim, mixer.value_head_dim
    qkv, z, b, a = proj.split([mixer.conv_dim, mixer.value_dim, hv, hv], dim=-1)
    weight = mixer.conv_weight
    conv = torch.stack(conv_states)  # [B, C, K - 1]
    seq = torch.cat([conv.to(weight.dtype), qkv.to(weight.dtype)[:, :, None]], dim=2)
    for b_, state in enumerate(conv_states):
        if state.shape[1]:
            state.copy_(seq[b_, :, seq.shape[2] - state.shape[1]:])
    qkv = F.silu((seq * weight).sum(dim=2))
    q, k, v = qkv.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    beta = torch.sigmoid(b.float())
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias.float())
    recurrent = torch.stack(recurrent_states)  # [B, Hv, Dk, Dv]
    if fla_available(proj.device):
        o, new = _fla_step(q, k, v, g, beta, recurrent)
    else:
        # the B sequences' heads side by side as the heads of one token (per-head rule)
        qn = (l2_normalize(q) * (dk ** -0.5)).reshape(1, n * hk, dk)
        kn = l2_normalize(k).reshape(1, n * hk, dk)
        o, new = recurrent_gated_delta_rule(qn, kn, v.reshape(1, n * hv, dv), g.reshape(1, n * hv),
                                            beta.reshape(1, n * hv), recurrent.reshape(n * hv, dk, dv))
        o, new = o.reshape(n, hv, dv), new.reshape(n, hv, dk, dv)
    for b_, state in enumerate(recurrent_states):
        state.copy_(new[b_])
    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + mixer.eps)
    o = o * mixer.norm_weight.float() * F.silu(z.reshape(n, hv, dv).float())
    return o.reshape(n, mixer.value_dim).to(proj.dtype)


def _fla_step(q, k, v, g, beta, recurrent):
    """flash-linear-attention's fused recurrent rule over a batch of B sequences of one token
    (``[B, 1, H, D]`` inputs, key heads expanded; q/k normalised in the kernel as the single
    sequence path asks). Returns ``(o [B, Hv, Dv], new state [B, Hv, Dk, Dv])``."""
    _chunk, rec_fn = _fla_funcs()
    hv = v.shape[1]
    q = q.repeat_interleave(hv // q.shape[1], dim=1)
    k = k.repeat_interleave(hv // k.shape[1], dim=1)
    o, final = rec_fn(q=q[:, None].contiguous(), k=k[:, None].contiguous(), v=v[:, None].contiguous(),
                      g=g[:, None].contiguous(), beta=beta.to(q.dtype)[:, None].contiguous(),
                      initial_state=recurrent.float().contiguous(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    return o[:, 0], final
