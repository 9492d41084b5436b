"""The operations of the graph-capturable one-token decode step, in two implementations.

The decode step (:meth:`redlite.models.llama.LlamaModel.decode_step`) takes the token and
its position as device tensors, so it can be captured once in a CUDA graph and replayed at
any position. Its work goes through a decode-ops object, per layer: ``norm_linear`` (input
norm + qkv), ``rope_attend`` (q/k norm, rotary, KV write, attention), ``linear_residual``
(o projection + residual add), ``norm_gate_up`` (post-attention norm + gate/up + silu),
``linear_residual`` (down projection + residual add); at the end ``norm_linear`` (final norm
+ lm_head):

* :class:`TorchDecodeOps`: plain torch ops, on any device; the same arithmetic as the
  eager forward pass (it is the reference). Its attention reads ``span`` cache slots and
  masks those past ``pos``, so a graph captured with it serves positions ``< span`` (the
  graph runner keeps one graph per span "bucket"). The unused cache slots must hold finite
  values (the runner zeroes them once).
* :class:`~redlite.layers.triton_ops.TritonDecodeOps` (CUDA with Triton): each of those five steps is one kernel, from
  :mod:`redlite.layers.triton_gemv` and :mod:`redlite.layers.triton_decode`; attention
  reads only the keys up to ``pos``, so ``span`` is ignored and one graph serves every
  position (``length_from_pos`` True).

:func:`decode_ops` picks one for a device, dtype and head size.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from redlite.layers.norm import rms_norm, zero_centered_rms_norm
from redlite.layers.rotary import apply_rotary

log = logging.getLogger("redlite.decode_ops")


class TorchDecodeOps:
    """Reference implementation (any device). ``length_from_pos``: False (attention reads
    ``span`` slots)."""

    name = "torch"
    length_from_pos = False

    def __init__(self, linear=F.linear):
        self.linear = linear  # fn(x [T, in], weight [out, in], bias | None) -> [T, out]

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, out_float32: bool = False,
                    zero_centered: bool = False) -> torch.Tensor:
        """``linear(rms_norm(x))``: ``x`` [1, K], ``weight`` [N, K] -> new [1, N] in x's dtype,
        or float32 after that rounding when ``out_float32`` (the logits). ``zero_centered``:
        the Qwen3.5 norm (:func:`redlite.layers.norm.zero_centered_rms_norm`)."""
        y = self.linear(self._norm(x, norm_weight, eps, zero_centered), weight, bias)
        return y.float() if out_float32 else y

    def _norm(self, x, weight, eps, zero_centered):
        return zero_centered_rms_norm(x, weight, eps) if zero_centered else self.rms_norm(x, weight, eps)

    def linear_residual(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor) -> torch.Tensor:
        """``residual += linear(x)`` in place (``x`` [1, K], ``residual`` [1, N]); returns it."""
        return residual.add_(self.linear(x, weight, bias))

    def norm_gate_up(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None, inter: int, zero_centered: bool = False) -> torch.Tensor:
        """``silu(gate) * up`` of ``linear(rms_norm(x))`` with the fused gate/up ``weight``
        [2 * inter, K] (gate rows first) -> new [1, inter]. ``zero_centered``: as in
        :meth:`norm_linear`."""
        return self.silu_mul(self.linear(self._norm(x, norm_weight, eps, zero_centered), weight, bias), inter)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x`` [T, n] -> new [T, n] (see :func:`redlite.layers.norm.rms_norm`)."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += delta`` in place ([T, n], rounded to x's dtype), then RMSNorm of x (new tensor)."""
        x.add_(delta)
        return rms_norm(x, weight, eps)

    def qk_rope_store(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      norm_weight: torch.Tensor | None, eps: float, keys: torch.Tensor,
                      values: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Split the fused projection ``qkv`` [1, (H + 2 KV) * D] into heads, RMSNorm q and k
        per head when ``norm_weight`` ([H + KV, D]) is given, rotate them to position ``pos``
        (LongTensor [1]; ``cos``/``sin`` the whole tables ``[positions, 1, rotary_dim]`` from
        :meth:`RotaryTable.get`), write k and v into ``keys``/``values`` [KV, max_tokens, D]
        at ``pos``; return q [H, D] (new tensor, qkv's dtype)."""
        qk_dim = (n_heads + n_kv_heads) * head_dim
        qk = qkv[:, :qk_dim].unflatten(-1, (n_heads + n_kv_heads, head_dim))
        if norm_weight is not None:
            qk = rms_norm(qk, norm_weight, eps)
        qk = apply_rotary(qk, cos.index_select(0, pos), sin.index_select(0, pos))
        v = qkv[:, qk_dim:].unflatten(-1, (n_kv_heads, head_dim))
        keys.index_copy_(1, pos, qk[:, n_heads:].transpose(0, 1))
        values.index_copy_(1, pos, v.transpose(0, 1))
        return qk[0, :n_heads]

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                  span: int, window: int | None) -> torch.Tensor:
        """Attention of ``q`` [H, D] over cache rows ``0..pos`` (the last ``window`` with a
        sliding window) of ``keys``/``values`` [KV, max_tokens, D]; reads rows ``< span``
        (``span > pos``). Returns [H, D]."""
        n_heads, head_dim = q.shape
        n_kv = keys.shape[0]
        slots = torch.arange(span, device=q.device)
        valid = slots <= pos
        if window is not None:
            valid &= slots > pos - window
        qg = q.view(1, n_kv, n_heads // n_kv, head_dim)
        out = F.scaled_dot_product_attention(qg, keys[None, :, :span], values[None, :, :span],
                                             attn_mask=valid.view(1, 1, 1, span))
        return out.reshape(n_heads, head_dim)

    def rope_attend(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    norm_weight: torch.Tensor | None, eps: float, keys: torch.Tensor, values: torch.Tensor,
                    n_heads: int, n_kv_heads: int, head_dim: int, span: int, window: int | None) -> torch.Tensor:
        """:meth:`qk_rope_store` then :meth:`attention`: one token's attention from its fused
        projection ``qkv`` [1, (H + 2 KV) * D]; writes its k/v at ``pos``; returns [H, D]."""
        q = self.qk_rope_store(qkv, pos, cos, sin, norm_weight, eps, keys, values, n_heads, n_kv_heads, head_dim)
        return self.attention(q, keys, values, pos, span, window)

    def chunk_rope_attend(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          norm_weight: torch.Tensor | None, eps: float, keys: torch.Tensor, values: torch.Tensor,
                          n_heads: int, n_kv_heads: int, head_dim: int, span: int,
                          window: int | None) -> torch.Tensor:
        """:meth:`rope_attend` of T consecutive tokens of one sequence: row t of ``qkv``
        [T, (H + 2 KV) * D] at position ``pos + t`` (``pos`` LongTensor [1]); every k/v row is
        written before attention, so token t sees rows ``0 .. pos + t`` (the last ``window``).
        Reads rows ``< span`` (``span >= pos + T``). Returns [T, H * D]."""
        n_tokens = qkv.shape[0]
        positions = pos + torch.arange(n_tokens, device=qkv.device)
        qk_dim = (n_heads + n_kv_heads) * head_dim
        qk = qkv[:, :qk_dim].unflatten(-1, (n_heads + n_kv_heads, head_dim))
        if norm_weight is not None:
            qk = rms_norm(qk, norm_weight, eps)
        qk = apply_rotary(qk, cos.index_select(0, positions), sin.index_select(0, positions))
        v = qkv[:, qk_dim:].unflatten(-1, (n_kv_heads, head_dim))
        keys.index_copy_(1, positions, qk[:, n_heads:].transpose(0, 1))
        values.index_copy_(1, positions, v.transpose(0, 1))
        slots = torch.arange(span, device=qkv.device)[None, :]
        valid = slots <= positions[:, None]
        if window is not None:
            valid &= slots > positions[:, None] - window
        q = qk[:, :n_heads].transpose(0, 1)[None]  # [1, H, T, D]
        out = F.scaled_dot_product_attention(q, keys[None, :, :span], values[None, :, :span],
                                             attn_mask=valid[None, None], enable_gqa=n_heads != n_kv_heads)
        return out[0].transpose(0, 1).reshape(n_tokens, n_heads * head_dim)

    def batch_rope_attend(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          norm_weight: torch.Tensor | None, eps: float, caches, layer: int, n_heads: int,
                          n_kv_heads: int, head_dim: int, span: int, window: int | None,
                          gated: bool = False, k_norm: torch.Tensor | None = None,
                          table: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`rope_attend` (``gated``: :meth:`gated_rope_attend` with ``norm_weight`` the
        q norm and ``k_norm``) of B sequences: row b of ``qkv`` [B, width] at ``pos[b]``
        (LongTensor [B]) into ``caches[b]`` (:class:`~redlite.layers.kv_cache.KVCache`),
        cache layer ``layer``. ``table``: the states' :meth:`slot_table` (ops that address
        the caches through it). Returns [B, H * D]. Here: one sequence at a time."""
        rows = []
        for b, cache in enumerate(caches):
            keys, values = cache.keys[layer], cache.values[layer]
            if gated:
                rows.append(self.gated_rope_attend(qkv[b:b + 1], pos[b:b + 1], cos, sin, norm_weight, k_norm, eps,
                                                   keys, values, n_heads, n_kv_heads, head_dim, span))
            else:
                rows.append(self.rope_attend(qkv[b:b + 1], pos[b:b + 1], cos, sin, norm_weight, eps, keys, values,
                                             n_heads, n_kv_heads, head_dim, span, window).reshape(1, -1))
        return torch.cat(rows)

    #: whether the batched ops read the states through :meth:`slot_table`
    by_address = False

    def slot_table(self, states) -> torch.Tensor | None:
        """The address table the batched ops read the states through
        (:func:`~redlite.models.slot_table.slot_table`); None: these ops take the states'
        tensors themselves."""
        return None

    def batch_gdn_step(self, proj: torch.Tensor, states, layer: int, mixer,
                       table: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`gdn_step` of B sequences: row b of ``proj`` [B, width] over ``states[b]``'s
        conv and recurrent states of layer ``layer`` (updated in place); ``table`` as in
        :meth:`batch_rope_attend`. Returns [B, Hv * Dv]. Here: one sequence at a time."""
        return torch.cat([self.gdn_step(proj[b:b + 1], state.conv[layer], state.recurrent[layer], mixer)
                          for b, state in enumerate(states)]).view(len(states), -1)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` [T, 2 * inter] (gate first) -> new [T, inter]."""
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate).mul_(up)

    # --- the Qwen3.5 hybrid family ---------------------------------------------------------

    def gated_rope_attend(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, keys: torch.Tensor,
                          values: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                          span: int) -> torch.Tensor:
        """Qwen3.5 gated attention of one token (as
        :class:`redlite.layers.gated_attention.GatedAttention` computes it) from its fused
        projection ``qkv`` [1, (2H + 2 KV) * D] (per query head D query then D gate
        features, then k, then v): zero-centred q/k norm (``q_norm``/``k_norm`` [D]), partial
        rotary at ``pos``, k/v written at ``pos``, attention over rows ``0..pos``, times
        ``sigmoid(gate)``. Returns [1, H * D] (the o projection's input)."""
        h, kv, d = n_heads, n_kv_heads, head_dim
        q, gate = qkv[0, :2 * h * d].view(h, 2 * d).split(d, dim=-1)
        k = qkv[0, 2 * h * d:(2 * h + kv) * d].view(kv, d)
        v = qkv[0, (2 * h + kv) * d:].view(kv, d)
        c, s = cos.index_select(0, pos), sin.index_select(0, pos)
        q = apply_rotary(zero_centered_rms_norm(q, q_norm, eps)[None], c, s)[0]
        k = apply_rotary(zero_centered_rms_norm(k, k_norm, eps)[None], c, s)[0]
        keys.index_copy_(1, pos, k[:, None])
        values.index_copy_(1, pos, v[:, None])
        out = self.attention(q, keys, values, pos, span, None).reshape(1, h * d)
        return out * torch.sigmoid(gate.reshape(1, h * d))

    def chunk_gated_rope_attend(self, qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                                keys: torch.Tensor, values: torch.Tensor, n_heads: int, n_kv_heads: int,
                                head_dim: int, span: int) -> torch.Tensor:
        """:meth:`gated_rope_attend` of T consecutive tokens of one sequence: row t of ``qkv``
        [T, (2H + 2 KV) * D] at position ``pos + t`` (``pos`` LongTensor [1]); every k/v row
        is written before attention, so token t sees rows ``0 .. pos + t``. Reads rows
        ``< span`` (``span >= pos + T``). Returns [T, H * D]."""
        h, kv, d = n_heads, n_kv_heads, head_dim
        n_tokens = qkv.shape[0]
        positions = pos + torch.arange(n_tokens, device=qkv.device)
        q, gate = qkv[:, :2 * h * d].view(n_tokens, h, 2 * d).split(d, dim=-1)
        k = qkv[:, 2 * h * d:(2 * h + kv) * d].view(n_tokens, kv, d)
        v = qkv[:, (2 * h + kv) * d:].view(n_tokens, kv, d)
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        q = apply_rotary(zero_centered_rms_norm(q, q_norm, eps), c, s)
        k = apply_rotary(zero_centered_rms_norm(k, k_norm, eps), c, s)
        keys.index_copy_(1, positions, k.transpose(0, 1))
        values.index_copy_(1, positions, v.transpose(0, 1))
        valid = torch.arange(span, device=qkv.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None, :, :span], values[None, :, :span],
                                             attn_mask=valid[None, None], enable_gqa=h != kv)
        out = out[0].transpose(0, 1).reshape(n_tokens, h * d)
        return out * torch.sigmoid(gate.reshape(n_tokens, h * d))

    def moe(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, moe,
            zero_centered: bool = True) -> torch.Tensor:
        """``x += moe(rms_norm(x))`` in place for one token ``x`` [1, H], ``moe`` a
        :class:`~redlite.layers.moe.SparseMoE` (its gathered path: the chosen experts by
        device-tensor ids); returns ``x``."""
        return x.add_(moe(self._norm(x, norm_weight, eps, zero_centered)))

    def gdn_step(self, proj: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                 mixer) -> torch.Tensor:
        """One token through the Gated DeltaNet layer ``mixer`` between its projections:
        ``proj`` [1, C + Hv*Dv + 2*Hv] -> [1, Hv*Dv]; the states are updated in place (see
        :meth:`redlite.layers.gated_deltanet.GatedDeltaNet.mix`, run without fla)."""
        return mixer.mix(proj, conv_state, recurrent_state, use_fla=False)


def triton_available() -> bool:
    """True when Triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken install: use torch ops
        return False
    return True


def decode_ops(device: torch.device | str, dtype: torch.dtype, head_dim: int, n_kv_heads: int,
               linear=F.linear, *, triton: bool = True, pdl: int | None = None,
               gemv_configs: str | None = None, batch_invariant: bool = False) -> TorchDecodeOps:
    """The ops for a decode step on ``device`` in ``dtype``: Triton kernels on CUDA for
    float32/bfloat16/float16 and a power-of-two ``head_dim`` >= 16 when ``triton`` and Triton
    imports (``pdl``, ``gemv_configs``, ``batch_invariant``: see :class:`TritonDecodeOps`), else the torch
    reference with ``linear`` (the model's linear function)."""
    device = torch.device(device)
    pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if (device.type == "cuda" and pow2 and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and triton and triton_available()):
        from redlite.layers.triton_ops import TritonDecodeOps

        return TritonDecodeOps(device, n_kv_heads, head_dim=head_dim, pdl=pdl, gemv_configs=gemv_configs,
                               batch_invariant=batch_invariant)
    if device.type == "cuda" and triton:
        log.warning("decode step uses torch ops (Triton missing or head_dim %d unsupported)", head_dim)
    return TorchDecodeOps(linear)
