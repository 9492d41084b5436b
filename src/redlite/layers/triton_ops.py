"""The Triton implementation of the decode ops (CUDA; importable only where Triton is): see
:mod:`redlite.layers.decode_ops` for the contract and :func:`~redlite.layers.decode_ops.decode_ops`
for when it is chosen."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from redlite.layers.decode_ops import TorchDecodeOps
from redlite.models.slot_table import slot_table


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

    def chunk_rope_attend(self, qkv, pos, cos, sin, norm_weight, eps, keys, values, n_heads, n_kv_heads,
                          head_dim, span, window):
        from redlite.layers import triton_chunk_attention as tca

        return tca.chunk_attention(qkv.contiguous(), pos, cos, sin, norm_weight, eps, keys, values, n_heads,
                                   n_kv_heads, head_dim, window, self.n_splits)

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

    def chunk_gated_rope_attend(self, qkv, pos, cos, sin, q_norm, k_norm, eps, keys, values, n_heads,
                                n_kv_heads, head_dim, span):
        # row by row through the decode kernel, which reads keys up to its row's position (the
        # torch form's fixed span with a mask reads every cache row: bench/results/serve_gpu-*-s38)
        rows = [self.gated_rope_attend(qkv[t:t + 1], pos + t, cos, sin, q_norm, k_norm, eps, keys, values,
                                       n_heads, n_kv_heads, head_dim, span) for t in range(qkv.shape[0])]
        return torch.cat(rows)

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
