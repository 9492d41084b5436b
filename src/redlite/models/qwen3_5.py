"""Qwen3.5 dense hybrid text model: Gated DeltaNet layers mixed with gated full attention.

The layer pattern comes from config ``layer_types`` (``"linear_attention"`` /
``"full_attention"``; when absent, every ``full_attention_interval``-th layer, default 4, is
full attention, as transformers' ``Qwen3_5TextConfig`` does). Architecture as in
transformers 5.x ``models/qwen3_5/modeling_qwen3_5.py`` (the reference the parity tests
compare against):

* RMSNorm "Qwen3.5 flavour": ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` computed in
  float32 (weights are stored zero-centred), then cast back. Used for the layer norms, the
  final norm and the q/k norms.
* Full attention: ``q_proj`` yields, per head, ``[query (D) | gate (D)]``; q and k get the
  RMSNorm above over the head dim, then rotary embedding on the first
  ``int(D * partial_rotary_factor)`` dims (rotate-half form; default factor 0.25); GQA
  attention with scale ``D ** -0.5``; the output is multiplied by ``sigmoid(gate)`` before
  ``o_proj``. Text-only positions make the multimodal (M-RoPE) sections identical, so plain
  1-D rotary is exact for text.
* Linear attention: :class:`redlite.layers.gated_deltanet.GatedDeltaNet`.
* MLP: SwiGLU ``down(silu(gate(x)) * up(x))``.

Checkpoints: both the text-only layout (``Qwen3_5ForCausalLM``: ``model.layers...``,
``model.embed_tokens``, ``model.norm``, ``lm_head``) and the published multimodal layout
(``Qwen3_5ForConditionalGeneration``: config under ``text_config``, weights under
``model.language_model.*``; ``model.visual.*`` and ``mtp.*`` are ignored) load.

State (:class:`Qwen3_5State`): per linear-attention layer a conv state and a float32
recurrent state (fixed size); per full-attention layer a preallocated KV cache. The state
cannot be truncated (the recurrent part has no history); it rolls back through
:meth:`Qwen3_5State.export_recurrent` / :meth:`Qwen3_5State.import_recurrent`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from redlite.engine.base import EngineError
from redlite.layers.attention import causal_mask
from redlite.layers.gated_deltanet import GatedDeltaNet
from redlite.layers.kv_cache import KVCache
from redlite.layers.linear import linear_kernel
from redlite.layers.mlp import SwiGLU
from redlite.layers.rotary import RotaryTable, apply_rotary
from redlite.models.base import CausalLM, ModelState

__all__ = [
    "Qwen3_5Model",
    "Qwen3_5State",
    "text_config",
    "load_qwen3_5",
    "export_recurrent",
    "import_recurrent",
]

LINEAR = "linear_attention"
FULL = "full_attention"


# --- config -----------------------------------------------------------------------------------


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text-model part of a Qwen3.5 ``config.json`` dict, with defaults filled in.

    Accepts the text-only config (``model_type`` ``qwen3_5_text``) and the multimodal one
    (``qwen3_5``, text settings nested under ``text_config``). Fills ``layer_types`` from
    ``full_attention_interval`` (default 4), and resolves ``rope_theta`` /
    ``partial_rotary_factor`` from ``rope_parameters`` (transformers 5), ``rope_scaling`` or
    the top level (older files); defaults 10000 and 0.25 as in ``Qwen3_5TextConfig``.
    ``tie_word_embeddings`` is taken from the top level when present there (that is what
    transformers ties on), else from the text config.

    ``rope_parameters`` in the result is normalised for
    :meth:`~redlite.layers.rotary.RotaryTable.from_config` (an ``mrope`` type becomes
    ``default``: with text-only positions the three M-RoPE sections coincide).

    Raises ValueError for a ``layer_types`` entry other than ``linear_attention`` /
    ``full_attention`` or a ``hidden_act`` other than silu (an unsupported rope type raises
    when the model is built).
    """
    cfg = dict(config.get("text_config") or config)
    n_layers = int(cfg.get("num_hidden_layers", 32))
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
    layer_types = list(layer_types)[:n_layers]
    if len(layer_types) != n_layers or any(t not in (LINEAR, FULL) for t in layer_types):
        raise ValueError(f"bad layer_types for {n_layers} layers: {layer_types}")
    cfg["layer_types"] = layer_types

    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (Qwen3.5 uses silu)")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    rope["rope_type"] = "default" if rope_type == "mrope" else rope_type  # text: M-RoPE == 1-D
    rope["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope["partial_rotary_factor"] = float(rope.get("partial_rotary_factor",
                                                   cfg.get("partial_rotary_factor", 0.25)))
    cfg["rope_parameters"] = rope
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if "tie_word_embeddings" in config:
        cfg["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
    cfg.setdefault("tie_word_embeddings", False)
    return cfg


# --- small layers ---------------------------------------------------------------------------


def _param(*shape, device=None, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5 RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim.

    Computed in float32 and cast back to ``x``'s dtype after the multiply (transformers
    ``Qwen3_5RMSNorm``: the weight is stored zero-centred; unlike Llama, the multiply
    happens before the cast). ``weight``: ``[d]``. Returns ``x``'s shape and dtype.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """:func:`zero_centered_rms_norm` with a ``weight`` ``[dim]`` (uninitialised until loaded)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = _param(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)


class GatedAttention(nn.Module):
    """Qwen3.5 full attention: q/k zero-centred RMSNorm, partial rotary, GQA, sigmoid gate.

    Parameters (uninitialised until loaded; :meth:`hf_targets` maps checkpoint names):
    ``qkv_weight`` ``[(2*H + 2*Hkv) * D, hidden]`` (rows: ``q_proj`` — per head ``D`` query
    rows then ``D`` gate rows — then ``k_proj``, ``v_proj``), optional ``qkv_bias``;
    ``o_weight`` ``[hidden, H*D]``, optional ``o_bias``; ``q_norm_weight`` /
    ``k_norm_weight`` ``[D]``.
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 bias: bool = False, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.eps = float(eps)
        self.linear = linear_kernel(device, dtype)
        self.q_rows = 2 * n_heads * head_dim
        self.kv_rows = n_kv_heads * head_dim
        rows = self.q_rows + 2 * self.kv_rows
        self.qkv_weight = _param(rows, hidden, device=device, dtype=dtype)
        self.qkv_bias = _param(rows, device=device, dtype=dtype) if bias else None
        self.o_weight = _param(hidden, n_heads * head_dim, device=device, dtype=dtype)
        self.o_bias = _param(hidden, device=device, dtype=dtype) if bias else None
        self.q_norm_weight = _param(head_dim, device=device, dtype=dtype)
        self.k_norm_weight = _param(head_dim, device=device, dtype=dtype)

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint names (relative to ``...self_attn.``) -> parameter views."""
        q, kv = self.q_rows, self.kv_rows
        targets = {
            "q_proj.weight": self.qkv_weight[:q],
            "k_proj.weight": self.qkv_weight[q:q + kv],
            "v_proj.weight": self.qkv_weight[q + kv:],
            "o_proj.weight": self.o_weight,
            "q_norm.weight": self.q_norm_weight,
            "k_norm.weight": self.k_norm_weight,
        }
        if self.qkv_bias is not None:
            targets.update({"q_proj.bias": self.qkv_bias[:q], "k_proj.bias": self.qkv_bias[q:q + kv],
                            "v_proj.bias": self.qkv_bias[q + kv:], "o_proj.bias": self.o_bias})
        return targets

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attend ``x`` (``[T, hidden]``) at positions ``start .. start + T - 1``.

        ``cos``/``sin``: rotary tables ``[T, 1, rotary_dim]`` from
        :class:`~redlite.layers.rotary.RotaryTable`. ``keys``/``values``: this layer's cache
        ``[Hkv, max_tokens, D]``; rows ``< start`` are read, the T new ones written.
        ``mask``: bool ``[T, start + T]`` or None (causal from 0, or a single token).
        Returns ``[T, hidden]``.
        """
        n_new = x.shape[0]
        end = start + n_new
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.linear(x, self.qkv_weight, self.qkv_bias)
        q, gate = qkv[:, :self.q_rows].view(n_new, h, 2 * d).split(d, dim=-1)
        k = qkv[:, self.q_rows:self.q_rows + self.kv_rows].view(n_new, hkv, d)
        v = qkv[:, self.q_rows + self.kv_rows:].view(n_new, hkv, d)
        q = apply_rotary(zero_centered_rms_norm(q, self.q_norm_weight, self.eps), cos, sin)
        k = apply_rotary(zero_centered_rms_norm(k, self.k_norm_weight, self.eps), cos, sin)
        keys.narrow(1, start, n_new).copy_(k.transpose(0, 1))
        values.narrow(1, start, n_new).copy_(v.transpose(0, 1))
        if n_new == 1 and mask is None:
            # one query sees every held key: the query heads of each kv head become the
            # "positions" of one attention per kv head (no mask, no repeat of K/V)
            out = F.scaled_dot_product_attention(
                q.reshape(1, hkv, h // hkv, d), keys[None, :, :end], values[None, :, :end])
        else:
            # 4-D inputs: the CPU flash kernel rejects 3-D ones
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                is_causal=mask is None, enable_gqa=h != hkv)[0].transpose(0, 1)
        out = out.reshape(n_new, h * d) * torch.sigmoid(gate.reshape(n_new, h * d))
        return self.linear(out, self.o_weight, self.o_bias)


class DecoderLayer(nn.Module):
    """Pre-norm block: token mixer (``linear_attn`` or ``self_attn``) then SwiGLU ``mlp``."""

    def __init__(self, cfg: Mapping[str, Any], layer_type: str, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_type = layer_type
        hidden = int(cfg["hidden_size"])
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(
                hidden_size=hidden,
                num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
                num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
                key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
                value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
                conv_kernel_size=int(cfg.get("linear_conv_kernel_dim", 4)),
                eps=eps, device=device, dtype=dtype,
            )
        else:
            n_heads = int(cfg["num_attention_heads"])
            self.self_attn = GatedAttention(
                hidden, n_heads, int(cfg.get("num_key_value_heads") or n_heads),
                int(cfg.get("head_dim") or hidden // n_heads),
                bias=bool(cfg.get("attention_bias", False)), eps=eps, device=device, dtype=dtype)
        self.mlp = SwiGLU(hidden, int(cfg["intermediate_size"]), False, device, dtype)
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps, device, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps, device, dtype)

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint names (relative to ``model.layers.{i}.``) -> parameter views."""
        mixer, prefix = ((self.linear_attn, "linear_attn.") if self.layer_type == LINEAR
                         else (self.self_attn, "self_attn."))
        targets = {prefix + name: view for name, view in mixer.hf_targets().items()}
        inter = self.mlp.inter
        targets.update({
            "mlp.gate_proj.weight": self.mlp.gate_up_weight[:inter],
            "mlp.up_proj.weight": self.mlp.gate_up_weight[inter:],
            "mlp.down_proj.weight": self.mlp.down_weight,
            "input_layernorm.weight": self.input_layernorm.weight,
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight,
        })
        return targets


# --- state ----------------------------------------------------------------------------------


class Qwen3_5State(ModelState):
    """State of one sequence of a :class:`Qwen3_5Model`.

    * linear-attention layer ``i``: ``conv[i]`` ``[C, K - 1]`` in the compute dtype (the last
      ``K - 1`` inputs of the short convolution, zeros at start) and ``recurrent[i]``
      ``[Hv, Dk, Dv]`` float32 (the delta-rule memory); fixed size whatever ``n_past``;
    * full-attention layers: one :class:`~redlite.layers.kv_cache.KVCache` ``cache`` (slot
      ``kv_slot[i]`` for layer ``i``), ``[Hkv, max_tokens, D]`` per layer and K/V,
      preallocated uninitialised in the compute dtype; rows ``< n_past`` are valid.

    ``can_truncate`` is False as soon as there is one linear-attention layer: roll back with
    :meth:`export_recurrent` at position P and :meth:`import_recurrent` (which also cuts the
    KV caches to P).
    """

    def __init__(self, model: "Qwen3_5Model", max_tokens: int, device: torch.device | str, dtype: torch.dtype):
        if max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {max_tokens}")
        self.n_past = 0
        self.device = torch.device(device)
        self.dtype = dtype
        self.layer_types = list(model.layer_types)
        self.can_truncate = LINEAR not in self.layer_types
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.kv_slot: dict[int, int] = {}
        for i, layer in enumerate(model.layers):
            if layer.layer_type == LINEAR:
                mixer = layer.linear_attn
                self.conv[i] = torch.zeros(mixer.conv_state_shape(), device=self.device, dtype=dtype)
                self.recurrent[i] = torch.zeros(mixer.recurrent_state_shape(), device=self.device,
                                                dtype=torch.float32)
            else:
                self.kv_slot[i] = len(self.kv_slot)
        cfg = model.text_config
        n_heads = int(cfg["num_attention_heads"])
        self.cache = KVCache(len(self.kv_slot), int(cfg.get("num_key_value_heads") or n_heads),
                             int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
                             max_tokens, self.device, dtype)
        self.max_tokens = self.cache.max_tokens

    # --- sizes --------------------------------------------------------------------------------

    def recurrent_nbytes(self) -> int:
        """Bytes of the conv + recurrent states (one checkpoint payload); independent of n_past."""
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.recurrent.values()))

    def nbytes(self) -> int:
        """Bytes of the held part: conv + recurrent states plus ``n_past`` tokens of KV cache."""
        return self.recurrent_nbytes() + self.cache.nbytes(self.n_past)

    # --- rollback -----------------------------------------------------------------------------

    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens.

        With a linear-attention layer only ``n_tokens == n_past`` (a no-op) is allowed;
        otherwise raises ``EngineError`` (use :meth:`import_recurrent`). Pure-attention
        patterns truncate freely. Raises ``EngineError`` when out of range.
        """
        if not 0 <= n_tokens <= self.n_past:
            raise EngineError(f"cannot truncate to {n_tokens} tokens: {self.n_past} held")
        if n_tokens != self.n_past and not self.can_truncate:
            raise EngineError("Qwen3.5 state has recurrent layers: roll back with import_recurrent")
        self.n_past = int(n_tokens)

    def reset(self) -> None:
        """Back to the empty sequence (``n_past = 0``, zero conv/recurrent states) without
        reallocating: position 0 is the one rollback target that needs no checkpoint."""
        with torch.inference_mode():
            for t in (*self.conv.values(), *self.recurrent.values()):
                t.zero_()
        self.n_past = 0

    def export_recurrent(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Copies of every conv and recurrent state: the checkpoint payload at ``n_past``.

        Returns ``{"layers.{i}.conv": [C, K-1] compute dtype, "layers.{i}.recurrent":
        [Hv, Dk, Dv] float32}`` for each linear-attention layer ``i``, on ``device``
        (default: the state's device, fastest on GPU; ``"cpu"`` for host copies). Total
        size: :meth:`recurrent_nbytes`. KV caches are not included: they are append-only,
        so cutting them back (done by :meth:`import_recurrent`) restores them.
        """
        target = self.device if device is None else torch.device(device)
        out: dict[str, torch.Tensor] = {}
        for i in self.conv:
            out[f"layers.{i}.conv"] = self.conv[i].to(target, copy=True)
            out[f"layers.{i}.recurrent"] = self.recurrent[i].to(target, copy=True)
        return out

    def import_recurrent(self, tensors: Mapping[str, torch.Tensor], position: int) -> None:
        """Roll back to ``position`` tokens with a payload from :meth:`export_recurrent`.

        ``tensors`` must be what ``export_recurrent`` returned when ``n_past`` was
        ``position``, and the first ``position`` tokens held now must be those same tokens
        (the caller's bookkeeping). Copies the conv/recurrent states in (any device/dtype)
        and cuts the KV caches to ``position``. Raises ``EngineError`` when
        ``position > n_past`` or names/shapes do not match; the state is unchanged then.
        """
        if not 0 <= position <= self.n_past:
            raise EngineError(f"cannot roll back to {position} tokens: {self.n_past} held")
        targets = self._recurrent_targets()
        self._check(tensors, targets)
        with torch.inference_mode():
            for name, dest in targets.items():
                dest.copy_(tensors[name])
        self.n_past = int(position)

    def _recurrent_targets(self) -> dict[str, torch.Tensor]:
        targets = {}
        for i in self.conv:
            targets[f"layers.{i}.conv"] = self.conv[i]
            targets[f"layers.{i}.recurrent"] = self.recurrent[i]
        return targets

    # --- parking ------------------------------------------------------------------------------

    def export(self, n_tokens: int | None = None) -> dict[str, torch.Tensor]:
        """Contiguous CPU copies of the whole held state: the :meth:`export_recurrent`
        tensors plus ``"kv"`` ``[n_full_layers, 2, Hkv, n_tokens, D]`` (as
        :meth:`KVCache.export <redlite.layers.kv_cache.KVCache.export>`). Size:
        :meth:`nbytes`. ``n_tokens`` must equal ``n_past`` unless ``can_truncate``;
        raises ``EngineError`` otherwise.
        """
        n = self.n_past if n_tokens is None else int(n_tokens)
        if not 0 <= n <= self.n_past or (n != self.n_past and not self.can_truncate):
            raise EngineError(f"cannot export {n} tokens of a Qwen3.5 state holding {self.n_past}")
        out = {name: t.contiguous() for name, t in self.export_recurrent("cpu").items()}
        out["kv"] = self.cache.export(n)
        return out

    def load(self, tensors: Mapping[str, torch.Tensor], n_past: int) -> None:
        """Replace the state by ``tensors`` from :meth:`export` holding ``n_past`` tokens.

        Tensors are copied to the state's device and dtype. Raises ``EngineError`` when
        names or shapes do not match or ``n_past > max_tokens``; the state is unchanged then.
        """
        if not 0 <= n_past <= self.max_tokens:
            raise EngineError(f"cannot load {n_past} tokens into a state of {self.max_tokens}")
        targets = self._recurrent_targets()
        expected = dict(targets)
        kv = self.cache.data[:, :, :, :n_past]
        expected["kv"] = kv
        self._check(tensors, expected)
        with torch.inference_mode():
            for name, dest in targets.items():
                dest.copy_(tensors[name])
            kv.copy_(tensors["kv"])
        self.n_past = int(n_past)

    @staticmethod
    def _check(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
        if set(tensors) != set(expected):
            missing = sorted(set(expected) - set(tensors))
            extra = sorted(set(tensors) - set(expected))
            raise EngineError(f"state tensors do not match this model: missing {missing[:4]}, "
                              f"unexpected {extra[:4]}")
        for name, dest in expected.items():
            if tuple(tensors[name].shape) != tuple(dest.shape):
                raise EngineError(f"state tensor {name}: shape {tuple(tensors[name].shape)}, "
                                  f"expected {tuple(dest.shape)}")


def export_recurrent(state: Qwen3_5State, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Module-level alias of :meth:`Qwen3_5State.export_recurrent`."""
    return state.export_recurrent(device)


def import_recurrent(state: Qwen3_5State, tensors: Mapping[str, torch.Tensor], position: int) -> None:
    """Module-level alias of :meth:`Qwen3_5State.import_recurrent`."""
    state.import_recurrent(tensors, position)


# --- model ----------------------------------------------------------------------------------

_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def _local_name(hf_name: str) -> str | None:
    """Map a checkpoint name to a text-model name, or None to ignore it.

    ``model.language_model.X`` (multimodal, transformers 5 ``Qwen3_5ForConditionalGeneration``)
    and ``model.X`` (text-only ``Qwen3_5ForCausalLM``) become ``X`` (e.g.
    ``layers.0.linear_attn.A_log``); ``lm_head.weight`` stays; vision tower
    (``model.visual.*``) and multi-token-prediction (``mtp.*``) weights are ignored.
    """
    if hf_name.startswith(_IGNORED_PREFIXES):
        return None
    if hf_name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for prefix in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return hf_name[len(prefix):]
    return None


class Qwen3_5Model(CausalLM):
    """Qwen3.5 dense hybrid causal LM over one sequence (see the module docstring).

    ``Qwen3_5Model(config, device, dtype)`` takes a ``config.json`` dict of either layout;
    weights are created uninitialised on ``device`` in ``dtype`` (``A_log``/``dt_bias``
    float32); fill them with :meth:`load_hf_weights`, or use :func:`load_qwen3_5`.
    """

    def __init__(self, config: Mapping[str, Any], device: torch.device | str | None = "cpu",
                 dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__()
        self.config = dict(config)
        cfg = text_config(config)
        self.text_config = cfg
        self.layer_types: list[str] = cfg["layer_types"]
        self.vocab_size = int(cfg["vocab_size"])
        self.max_position_embeddings = int(cfg.get("max_position_embeddings", 32768))
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
        self.rotary = RotaryTable.from_config(
            {"rope_parameters": cfg["rope_parameters"],
             "max_position_embeddings": self.max_position_embeddings},
            head_dim, partial_rotary_factor=cfg["partial_rotary_factor"])
        self.embed_weight = _param(self.vocab_size, hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, device, dtype) for t in self.layer_types)
        self.norm = ZeroCenteredRMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)), device, dtype)
        self.tied = bool(cfg["tie_word_embeddings"])
        self.lm_head_weight = self.embed_weight if self.tied else _param(
            self.vocab_size, hidden, device=device, dtype=dtype)
        self.linear = linear_kernel(device, dtype)

    # --- weights --------------------------------------------------------------------------------

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Text-model checkpoint names (after :func:`_local_name`) -> parameter views."""
        targets = {"embed_tokens.weight": self.embed_weight, "norm.weight": self.norm.weight}
        if not self.tied:
            targets["lm_head.weight"] = self.lm_head_weight
        for i, layer in enumerate(self.layers):
            targets.update({f"layers.{i}.{name}": view for name, view in layer.hf_targets().items()})
        return targets

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill the parameters from checkpoint tensors of either layout (text-only
        ``model.*`` or multimodal ``model.language_model.*``; vision and MTP ignored).

        Tensors may be on any device/dtype; they are copied into the parameters (which keep
        their device and dtype). When ``lm_head.weight`` is absent the output projection is
        tied to the embeddings. Raises ``KeyError`` naming the first missing weight,
        ``ValueError`` for a shape mismatch.
        """
        targets = self.hf_targets()
        seen: set[str] = set()
        with torch.no_grad():
            for hf_name in tensors.keys():
                name = _local_name(hf_name)
                dest = targets.get(name) if name else None
                if dest is None:
                    continue
                tensor = tensors[hf_name]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor)
                seen.add(name)
        if not self.tied and "lm_head.weight" not in seen:
            self.tied = True
            self.lm_head_weight = self.embed_weight
            del targets["lm_head.weight"]
        for name in targets:
            if name not in seen:
                raise KeyError(f"missing weight {name!r} (checkpoint names model.{name} or "
                               f"model.language_model.{name})")

    # --- state + forward ------------------------------------------------------------------------

    def new_state(self, max_tokens: int, device: torch.device | str, dtype: torch.dtype) -> Qwen3_5State:
        """A fresh empty :class:`Qwen3_5State` with KV room for ``max_tokens`` tokens; conv
        and KV tensors in ``dtype``, recurrent states float32, all on ``device``."""
        return Qwen3_5State(self, max_tokens, device, dtype)

    def forward(self, input_ids: torch.Tensor, state: Qwen3_5State, all_logits: bool = False) -> torch.Tensor:
        """Append ``input_ids`` (LongTensor ``[T]``) at ``state.n_past``; see
        :meth:`CausalLM.forward`. Returns float32 logits ``[1, vocab]`` (or ``[T, vocab]``).
        Raises ``ContextOverflow`` (state untouched) when the tokens do not fit."""
        n_new = int(input_ids.shape[0])
        state.check_room(n_new)
        start = state.n_past
        x = F.embedding(input_ids, self.embed_weight)
        cos = sin = mask = None
        if state.kv_slot:
            cos, sin = self.rotary.get(start, start + n_new, x.device, x.dtype)
            if start > 0 and n_new > 1:
                mask = causal_mask(start, n_new, None, x.device)
        keys, values = state.cache.keys, state.cache.values
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if layer.layer_type == LINEAR:
                h = layer.linear_attn(h, state.conv[i], state.recurrent[i])
            else:
                slot = state.kv_slot[i]
                h = layer.self_attn(h, start, cos, sin, keys[slot], values[slot], mask)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        state.n_past = start + n_new
        if not all_logits:
            x = x[-1:]
        return self.linear(self.norm(x), self.lm_head_weight, None).float()


# --- loader ---------------------------------------------------------------------------------


def load_qwen3_5(path: str, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> Qwen3_5Model:
    """Build a :class:`Qwen3_5Model` from a Hugging Face directory (``config.json`` and
    ``*.safetensors``, sharded or not, either layout) with weights in ``dtype`` on ``device``
    (defaults as :func:`redlite.loading.hf.load_hf_model`: CUDA + bfloat16 when available,
    else CPU + float32).

    Tensors are read lazily, one at a time; vision-tower and MTP tensors are never read.
    Returns the model in eval mode. Raises ``FileNotFoundError`` when there is no config or
    safetensors file, ``KeyError`` for a missing weight. ``load_hf_model`` reaches the same
    class through the registry.
    """
    from redlite.loading.hf import LazyTensors, default_device, default_dtype, read_config, safetensors_files

    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    model = Qwen3_5Model(read_config(path), device, dtype)
    with torch.inference_mode():
        model.load_hf_weights(LazyTensors(safetensors_files(path)))
    return model.eval()
