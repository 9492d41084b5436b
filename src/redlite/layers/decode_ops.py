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
* :class:`TritonDecodeOps` (CUDA with Triton): each of those five steps is one kernel, from
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
from redlite.models.slot_table import slot_table

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


class TritonDecodeOps(TorchDecodeOps):
    """Fused Triton kernels (CUDA). ``length_from_pos``: True (attention reads keys up to
    ``pos`` only; ``span`` is ignored). ``n_splits``: key slices per KV head in attention.

    ``fused_gemv`` (default True): the matrix-vector products are the Triton kernels of
    :mod:`redlite.layers.triton_gemv` with the norms, residual adds and ``silu * up`` fused
    in; False: cuBLAS (``F.linear``) with separate norm/add/activation kernels. ``pdl``: how
    the Triton kernels use programmatic dependent launch (0 off; 1 or 2, see
    :func:`redlite.layers.triton_gemv.pdl_sync`); None: ``DEFAULT_PDL`` where supported, else 0.
    ``gemv_configs``: a JSON file of GEMV launch settings
    (:func:`redlite.layers.triton_gemv.read_gemv_configs`; None: the built-in table; raises
    ``OSError``/``ValueError`` when unreadable). ``pdl_attention``: the mode of the attention kernel (0-2), default
    ``DEFAULT_PDL_ATTENTION`` when ``pdl`` is on: 0, a plain launch, because with PDL the H200
    decoded slower (bench/results/gpu-2026-11-29-nvidia-h200.md, decode-ops rows). ``name``: ``triton`` or ``triton+cublas``, then ``+pdl<mode>`` and
    ``-attn<mode>`` when attention's mode differs. ``batch_invariant`` (with ``fused_gemv``):
    the batched step takes the one-token step's ops on ``[B, K]`` rows (:func:`gemv` computes
    each row as alone) and slices attention as alone (``n_splits``), so each row is bitwise
    the lone step's (:mod:`redlite.models.batch_step`).
    """

    length_from_pos = True
    by_address = True
    DEFAULT_PDL = 1
    DEFAULT_PDL_ATTENTION = 0

    def __init__(self, device: torch.device, n_kv_heads: int, fused_gemv: bool = True,
                 pdl: int | None = None, pdl_attention: int | None = None, head_dim: int | None = None,
                 gemv_configs: str | None = None, batch_invariant: bool = False):
        super().__init__(F.linear)
        from redlite.layers import triton_decode, triton_gdn, triton_gemv

        self.kernels, self.gemv = triton_decode, triton_gemv
        self.n_splits = triton_decode.default_splits(torch.device(device), n_kv_heads, head_dim)
        # finished-slice counts of the attention kernel, one per KV head (it resets them)
        self.counters = torch.zeros(n_kv_heads, dtype=torch.int32, device=device)
        # finished-program counts of the Gated DeltaNet step, one per key head (it resets them)
        self.gdn_counters = torch.zeros(triton_gdn.MAX_KEY_HEADS, dtype=torch.int32, device=device)
        self._tables: dict = {}  # address tables of batched steps, by addresses
        self.fused_gemv = bool(fused_gemv)
        self.batch_invariant = bool(batch_invariant) and self.fused_gemv
        if pdl is None:
            pdl = self.DEFAULT_PDL if triton_gemv.pdl_supported(device) else 0
        if pdl_attention is None:
            pdl_attention = self.DEFAULT_PDL_ATTENTION if pdl else 0
        if pdl not in (0, 1, 2) or pdl_attention not in (0, 1, 2):
            raise ValueError(f"pdl and pdl_attention must be 0, 1 or 2, got {pdl!r}, {pdl_attention!r}")
        self.pdl, self.pdl_attention = int(pdl), int(pdl_attention)
        self.configs = triton_gemv.read_gemv_configs(gemv_configs) if gemv_configs else None
        self.name = ("triton" if self.fused_gemv else "triton+cublas") + (f"+pdl{self.pdl}" if self.pdl else "")
        self.name += f"-attn{self.pdl_attention}" if self.pdl_attention != self.pdl else ""

    def rms_norm(self, x, weight, eps):
        return self.kernels.add_rms_norm(x, None, weight, eps, pdl=self.pdl)

    def add_rms_norm(self, x, delta, weight, eps):
        return self.kernels.add_rms_norm(x, delta, weight, eps, pdl=self.pdl)

    def norm_linear(self, x, norm_weight, eps, weight, bias, out_float32=False, zero_centered=False):
        if not self.fused_gemv:
            return super().norm_linear(x, norm_weight, eps, weight, bias, out_float32, zero_centered)
        return self.gemv.gemv(x, weight, bias, norm_weight=norm_weight, eps=eps, out_float32=out_float32,
                              pdl=self.pdl, zero_centered=zero_centered, configs=self.configs)

    def linear_residual(self, x, weight, bias, residual):
        if not self.fused_gemv:
            return super().linear_residual(x, weight, bias, residual)
        return self.gemv.gemv(x, weight, bias, residual=residual, pdl=self.pdl, configs=self.configs)

    def norm_gate_up(self, x, norm_weight, eps, weight, bias, inter, zero_centered=False):
        if not self.fused_gemv:
            return super().norm_gate_up(x, norm_weight, eps, weight, bias, inter, zero_centered)
        return self.gemv.gemv(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=True, pdl=self.pdl,
                              zero_centered=zero_centered, configs=self.configs)

    def rope_attend(self, qkv, pos, cos, sin, norm_weight, eps, keys, values, n_heads, n_kv_heads, head_dim,
                    span, window):
        return self.kernels.decode_attention(qkv, pos, cos, sin, norm_weight, eps, keys, values, n_heads,
                                             n_kv_heads, head_dim, window, self.n_splits, self.counters,
                                             pdl=self.pdl_attention)

    def slot_table(self, states):
        return slot_table(states, self.counters.device, self._tables)

    def batch_rope_attend(self, qkv, pos, cos, sin, norm_weight, eps, caches, layer, n_heads, n_kv_heads,
                          head_dim, span, window, gated=False, k_norm=None, table=None):
        # one launch for all B sequences (the key-slice count spread over them)
        from redlite.layers import triton_batch_attention as tba

        batch = qkv.shape[0]
        bases = table[0] if table is not None else tba.cache_bases(caches, qkv.device)
        splits = self.n_splits if self.batch_invariant else tba.batch_splits(qkv.device, n_kv_heads, batch, head_dim)
        out = tba.batch_decode_attention(qkv.contiguous(), pos, cos, sin, norm_weight, eps, bases, caches[0], layer,
                                         n_heads, n_kv_heads, head_dim, window, splits, gated=gated,
                                         k_norm_weight=k_norm)
        return out.view(batch, -1)

    def silu_mul(self, gate_up, inter):
        return self.kernels.silu_mul(gate_up, inter, pdl=self.pdl)

    def gated_rope_attend(self, qkv, pos, cos, sin, q_norm, k_norm, eps, keys, values, n_heads, n_kv_heads,
                          head_dim, span):
        out = self.kernels.decode_attention(qkv, pos, cos, sin, q_norm, eps, keys, values, n_heads, n_kv_heads,
                                            head_dim, None, self.n_splits, self.counters,
                                            pdl=self.pdl_attention, gated=True, k_norm_weight=k_norm)
        return out.view(1, -1)

    def moe(self, x, norm_weight, eps, moe, zero_centered=True):
        from redlite.layers import triton_moe

        if not (self.fused_gemv and triton_moe.supported(moe)):
            return super().moe(x, norm_weight, eps, moe, zero_centered)
        return triton_moe.moe_step(x, norm_weight, eps, moe, zero_centered, pdl=self.pdl, configs=self.configs)

    def gdn_step(self, proj, conv_state, recurrent_state, mixer):
        from redlite.layers import triton_gdn

        m = mixer
        if not triton_gdn.supported(m.num_key_heads, m.num_value_heads, m.key_head_dim, m.value_head_dim,
                                    m.conv_kernel_size):
            return super().gdn_step(proj, conv_state, recurrent_state, mixer)
        return triton_gdn.gdn_step(proj, conv_state, recurrent_state, mixer, pdl=self.pdl,
                                   counters=self.gdn_counters)


    def batch_gdn_step(self, proj, states, layer, mixer, table=None):
        from redlite.layers import triton_gdn

        m = mixer
        if not triton_gdn.supported(m.num_key_heads, m.num_value_heads, m.key_head_dim, m.value_head_dim,
                                    m.conv_kernel_size):
            return super().batch_gdn_step(proj, states, layer, mixer, table)
        table = self.slot_table(states) if table is None else table
        conv_off, rec_off = states[0].layer_offsets(layer)
        return triton_gdn.gdn_step_batch(proj, table[1], table[2], conv_off, rec_off, states[0].conv[layer], mixer,
                                         pdl=self.pdl, counters=self.gdn_counters)


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
        return TritonDecodeOps(device, n_kv_heads, head_dim=head_dim, pdl=pdl, gemv_configs=gemv_configs,
                               batch_invariant=batch_invariant)
    if device.type == "cuda" and triton:
        log.warning("decode step uses torch ops (Triton missing or head_dim %d unsupported)", head_dim)
    return TorchDecodeOps(linear)
