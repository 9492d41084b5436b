"""Gated DeltaNet token mixer (the ``linear_attention`` layers of Qwen3.5 / Qwen3-Next).

Architecture: Yang, Kautz, Hatamizadeh, "Gated Delta Networks" (2024); the layout of
projections, short convolution, gates and gated output norm follows the Qwen3.5 checkpoints
as read by transformers' ``Qwen3_5GatedDeltaNet`` (checkpoint names in
:meth:`GatedDeltaNet.hf_targets`).

Per token ``x`` (``hidden_size``):

1. ``in_proj_qkv(x)`` -> ``[q | k | v]`` (``2 * Hk * Dk + Hv * Dv`` channels), passed
   through a depthwise causal convolution of width ``K`` (``conv1d.weight``
   ``[C, 1, K]``, no bias) and SiLU. The convolution needs the previous ``K - 1`` inputs:
   that is the *conv state*, ``[C, K - 1]`` in the compute dtype.
2. ``beta = sigmoid(in_proj_b(x))`` (writing strength), ``g = -exp(A_log) *
   softplus(in_proj_a(x) + dt_bias)`` (log decay, <= 0), one per value head, float32.
3. q and k are L2-normalised per head, q scaled by ``Dk ** -0.5``, and the gated delta rule
   (:mod:`redlite.layers.delta_rule`) runs over the *recurrent state* ``[Hv, Dk, Dv]``,
   kept in float32.
4. The per-head output is RMS-normalised (plain ``weight``, not ``1 + weight``), multiplied
   by ``silu(in_proj_z(x))`` and projected by ``out_proj``.

Prefill (T > 1) uses the chunked form (chunk 64); decode (T == 1) the recurrent form. On
CUDA, when the ``flash-linear-attention`` package is importable (and the layer's ``fla`` is
True: the CLI's ``--no-fla`` clears it), its Triton kernels ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
replace the PyTorch ones; with fla, pieces of up to ``recurrent_max_tokens`` tokens (a second
turn's suffix) also take the recurrent kernel: one launch where the chunked form's host work
is the larger cost for so few tokens (bench/results/short-prefill-*).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redlite.layers.delta_rule import (
    DEFAULT_CHUNK_SIZE,
    chunk_gated_delta_rule,
    expand_key_heads,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from redlite.layers.linear import linear_kernel

__all__ = ["GatedDeltaNet", "causal_conv1d", "fla_available"]

_FLA_FUNCS: tuple | None | bool = False  # False: not probed yet; None: unavailable


def _fla_funcs():
    """``(chunk_fn, recurrent_fn)`` from flash-linear-attention, or None when unavailable."""
    global _FLA_FUNCS
    if _FLA_FUNCS is False:
        _FLA_FUNCS = None
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk_fn
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as rec_fn

            _FLA_FUNCS = (chunk_fn, rec_fn)
        except Exception:  # ImportError, or a Triton/CUDA mismatch at import time
            _FLA_FUNCS = None
    return _FLA_FUNCS


def fla_available(device: torch.device) -> bool:
    """True when the flash-linear-attention kernels will be used for tensors on ``device``."""
    return torch.device(device).type == "cuda" and _fla_funcs() is not None


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                  last: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution continuing from ``conv_state``, then SiLU.

    x: ``[T, C]`` new inputs. conv_state: ``[C, K - 1]``, the previous ``K - 1`` inputs
    (zeros at sequence start); updated in place to the last ``K - 1`` inputs (``last``, a
    LongTensor [1] on x's device: to the ``K - 1`` inputs ending at row ``last``, the rows
    after it being padding). weight: ``[C, K]`` (``conv1d.weight`` squeezed), tap ``K - 1``
    multiplies the newest input. Returns ``[T, C]`` in ``weight``'s dtype.
    """
    length = x.shape[0]
    window = conv_state.shape[1]
    seq = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype).transpose(0, 1)], dim=1)
    if window and last is not None:  # seq column window + t holds row t
        conv_state.copy_(seq.index_select(1, last + 1 + torch.arange(window, device=seq.device)))
    elif window:
        conv_state.copy_(seq[:, seq.shape[1] - window:])
    if length == 1:
        y = (seq * weight).sum(dim=1, keepdim=True)
    else:
        y = F.conv1d(seq.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0]).squeeze(0)
    return F.silu(y).transpose(0, 1)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer over a single sequence (no batch dimension).

    Args:
        hidden_size: model width.
        num_key_heads / num_value_heads: ``Hk`` / ``Hv`` (``Hv % Hk == 0``).
        key_head_dim / value_head_dim: ``Dk`` / ``Dv``.
        conv_kernel_size: ``K`` (4 in Qwen3.5).
        eps: epsilon of the gated output RMSNorm (config ``rms_norm_eps``).
        chunk_size: chunk length of the prefill form (64).
        device / dtype: where and how the weights are held (``A_log`` and ``dt_bias`` are
            always float32: the decay is computed in float32).

    Parameters (uninitialised until loaded; :meth:`hf_targets` maps checkpoint names onto
    them): ``in_proj_weight`` ``[C + Hv*Dv + 2*Hv, hidden]`` (rows: q, k, v, z, b, a; the
    four checkpoint projections fused into one matmul), ``conv_weight`` ``[C, K]``,
    ``dt_bias`` / ``A_log`` ``[Hv]``, ``norm_weight`` ``[Dv]``, ``out_weight``
    ``[hidden, Hv*Dv]``, with ``C = 2*Hk*Dk + Hv*Dv``.
    """

    recurrent_max_tokens = 32  # fla: pieces this short take the one-launch recurrent kernel

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int = 4,
        eps: float = 1e-6,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        device=None,
        dtype=None,
        linear=None,
        fla: bool = True,
    ) -> None:
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"linear_num_value_heads ({num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_key_heads})")
        self.hidden_size = hidden_size
        self.num_key_heads = num_key_heads
        self.num_value_heads = num_value_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.key_dim = num_key_heads * key_head_dim
        self.value_dim = num_value_heads * value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.eps = float(eps)
        self.chunk_size = chunk_size
        self.linear = linear or linear_kernel(device, dtype)
        self.fla = bool(fla)

        def param(*shape, dtype=dtype):
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)

        self.in_proj_weight = param(self.conv_dim + self.value_dim + 2 * num_value_heads, hidden_size)
        self.conv_weight = param(self.conv_dim, conv_kernel_size)
        self.dt_bias = param(num_value_heads, dtype=torch.float32)
        self.A_log = param(num_value_heads, dtype=torch.float32)
        self.norm_weight = param(value_head_dim)
        self.out_weight = param(hidden_size, self.value_dim)

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint names (relative to ``...linear_attn.``) -> the parameter view each is
        copied into (``in_proj_qkv/z/b/a.weight``, ``conv1d.weight`` ``[C, 1, K]``,
        ``dt_bias``, ``A_log``, ``norm.weight``, ``out_proj.weight``)."""
        c, vd, hv = self.conv_dim, self.value_dim, self.num_value_heads
        w = self.in_proj_weight
        return {
            "in_proj_qkv.weight": w[:c],
            "in_proj_z.weight": w[c:c + vd],
            "in_proj_b.weight": w[c + vd:c + vd + hv],
            "in_proj_a.weight": w[c + vd + hv:],
            "conv1d.weight": self.conv_weight.unsqueeze(1),
            "dt_bias": self.dt_bias,
            "A_log": self.A_log,
            "norm.weight": self.norm_weight,
            "out_proj.weight": self.out_weight,
        }

    # --- state shapes ---------------------------------------------------------------------

    def conv_state_shape(self) -> tuple[int, int]:
        """``(C, K - 1)``: channels of the q/k/v convolution and its history length."""
        return (self.conv_dim, self.conv_kernel_size - 1)

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """``(Hv, Dk, Dv)``: one ``Dk x Dv`` matrix per value head (float32)."""
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    # --- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
        """Mix ``x`` (``[T, hidden]``, T >= 1) into the sequence held by the two states.

        conv_state ``[C, K - 1]`` and recurrent_state ``[Hv, Dk, Dv]`` (float32) are updated
        in place to include the T tokens. Returns ``[T, hidden]`` in ``x``'s dtype.
        """
        proj = self.linear(x, self.in_proj_weight, None)
        return self.linear(self.mix(proj, conv_state, recurrent_state), self.out_weight, None)

    def mix(self, proj: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
            use_fla: bool | None = None, last: torch.Tensor | None = None) -> torch.Tensor:
        """Everything between the two projections: ``proj`` (``[T, C + Hv*Dv + 2*Hv]``, the
        input projection's output) -> ``[T, Hv*Dv]`` in proj's dtype, the gated-normalised
        output that ``out_proj`` takes; the states are updated in place as in :meth:`forward`.
        ``use_fla``: None uses flash-linear-attention where the layer's ``fla`` is set and
        :func:`fla_available`; False forces the torch kernels (the graph-capturable decode reference).
        ``last``: LongTensor [1] on proj's device, the last real row: the rows after it are
        padding, which leave both states as row ``last`` left them (their outputs are junk)."""
        length = proj.shape[0]
        hv, dk, dv = self.num_value_heads, self.key_head_dim, self.value_head_dim
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
        qkv = causal_conv1d(qkv, conv_state, self.conv_weight, last)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(length, self.num_key_heads, dk)
        k = k.reshape(length, self.num_key_heads, dk)
        v = v.reshape(length, hv, dv)

        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if last is not None:  # a padded row: no write (beta 0) and no decay (g 0)
            real = (torch.arange(length, device=proj.device) <= last).float()[:, None]
            beta, g = beta * real, g * real

        if (self.fla and fla_available(proj.device)) if use_fla is None else use_fla:
            o, new_state = self._fla_rule(q, k, v, g, beta, recurrent_state)
        else:
            qn = l2_normalize(q) * (dk ** -0.5)
            kn = l2_normalize(k)
            if length == 1:
                o, new_state = recurrent_gated_delta_rule(qn, kn, v, g, beta, recurrent_state)
            else:
                o, new_state = chunk_gated_delta_rule(qn, kn, v, g, beta, recurrent_state,
                                                      chunk_size=self.chunk_size)
        recurrent_state.copy_(new_state)

        # gated RMSNorm per value head: norm(o) * weight * silu(z)  (plain weight, eps inside)
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        o = o * self.norm_weight.float() * F.silu(z.reshape(length, hv, dv).float())
        return o.reshape(length, self.value_dim).to(proj.dtype)

    def _fla_rule(self, q, k, v, g, beta, recurrent_state):
        """The flash-linear-attention path (CUDA only; untested on CPU hosts).

        fla takes ``[B, T, H, D]`` inputs, normalises q/k itself
        (``use_qk_l2norm_in_kernel``), scales q by ``Dk ** -0.5`` by default and keeps the
        state as ``[B, H, Dk, Dv]`` (the layout used here). Key heads are expanded to value
        heads first so no grouped-head support is required from the installed version.
        """
        chunk_fn, rec_fn = _fla_funcs()
        hv = self.num_value_heads
        q = expand_key_heads(q, hv).unsqueeze(0).contiguous()
        k = expand_key_heads(k, hv).unsqueeze(0).contiguous()
        fn = rec_fn if q.shape[1] <= self.recurrent_max_tokens else chunk_fn
        o, final = fn(
            q=q,
            k=k,
            v=v.unsqueeze(0).contiguous(),
            g=g.unsqueeze(0).contiguous(),
            beta=beta.to(q.dtype).unsqueeze(0).contiguous(),
            initial_state=recurrent_state.unsqueeze(0).float().contiguous(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return o.squeeze(0), final.squeeze(0)
