"""Qwen3.5 dense hybrid text model: Gated DeltaNet layers mixed with gated full attention.

The layer pattern comes from config ``layer_types`` (``"linear_attention"`` /
``"full_attention"``; when absent, every ``full_attention_interval``-th layer, default 4, is
full attention, as transformers' ``Qwen3_5TextConfig`` does; see
:func:`~redlite.models.qwen3_5_config.text_config`). Architecture as in
transformers 5.x ``models/qwen3_5/modeling_qwen3_5.py`` (the reference the parity tests
compare against):

* RMSNorm "Qwen3.5 flavour" (:class:`~redlite.layers.norm.ZeroCenteredRMSNorm`):
  ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` computed in float32 (weights are stored
  zero-centred), then cast back. Used for the layer norms, the final norm and the q/k norms.
* Full attention (:class:`~redlite.layers.gated_attention.GatedAttention`): ``q_proj``
  yields, per head, ``[query (D) | gate (D)]``; q and k get the RMSNorm above over the head
  dim, then rotary embedding on the first ``int(D * partial_rotary_factor)`` dims
  (rotate-half form; default factor 0.25); GQA attention with scale ``D ** -0.5``; the
  output is multiplied by ``sigmoid(gate)`` before ``o_proj``. Text-only positions make the
  multimodal (M-RoPE) sections identical, so plain 1-D rotary is exact for text.
* Linear attention: :class:`redlite.layers.gated_deltanet.GatedDeltaNet`.
* MLP: SwiGLU ``down(silu(gate(x)) * up(x))``; in the mixture-of-experts models
  (``qwen3_5_moe`` / ``qwen3_5_moe_text``, config ``num_experts`` > 0) every layer's MLP is
  the sparse block :class:`~redlite.layers.moe.SparseMoE` (sizes from ``num_experts``,
  ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
  ``norm_topk_prob``); expert weights load from the fused or the per-expert layout.

Checkpoints: both the text-only layout (``Qwen3_5ForCausalLM``: ``model.layers...``,
``model.embed_tokens``, ``model.norm``, ``lm_head``) and the published multimodal layout
(``Qwen3_5ForConditionalGeneration``: config under ``text_config``, weights under
``model.language_model.*``; ``model.visual.*`` and ``mtp.*`` are ignored) load.

State (:class:`~redlite.models.qwen3_5_state.Qwen3_5State`): per linear-attention layer a
conv state and a float32 recurrent state (fixed size); per full-attention layer a
preallocated KV cache. The state cannot be truncated (the recurrent part has no history); it
rolls back through :meth:`Qwen3_5State.export_recurrent` /
:meth:`Qwen3_5State.import_recurrent`.

This module holds the decoder layer, the model and its loader; the config handling, the
state and the layers live in the modules named above, and their public names (``text_config``,
``LINEAR``/``FULL``, ``Qwen3_5State``, ``export_recurrent``/``import_recurrent``,
``GatedAttention``, ``ZeroCenteredRMSNorm``, ``zero_centered_rms_norm``) stay importable from
here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from redlite.engine.kernel_options import KernelOptions
from redlite.layers.attention import prefill_mask
from redlite.layers.gated_attention import GatedAttention
from redlite.layers.gated_deltanet import GatedDeltaNet
from redlite.layers.linear import linear_kernel
from redlite.layers.mlp import SwiGLU
from redlite.layers.moe import SparseMoE
from redlite.layers.norm import ZeroCenteredRMSNorm, zero_centered_rms_norm  # noqa: F401 (re-export)
from redlite.layers.rotary import RotaryTable
from redlite.models.base import CausalLM
from redlite.models.qwen3_5_config import FULL, LINEAR, text_config  # noqa: F401 (re-export)
from redlite.models.qwen3_5_state import Qwen3_5State, export_recurrent, import_recurrent

__all__ = [
    "Qwen3_5Model",
    "Qwen3_5State",
    "text_config",
    "load_qwen3_5",
    "export_recurrent",
    "import_recurrent",
]


def _param(*shape, device=None, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


# --- decoder layer --------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    """Pre-norm block: token mixer (``linear_attn`` or ``self_attn``) then SwiGLU ``mlp``."""

    def __init__(self, cfg: Mapping[str, Any], layer_type: str, device=None, dtype=None,
                 linear=None, fla: bool = True) -> None:
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
                eps=eps, device=device, dtype=dtype, linear=linear, fla=fla,
            )
        else:
            n_heads = int(cfg["num_attention_heads"])
            self.self_attn = GatedAttention(
                hidden, n_heads, int(cfg.get("num_key_value_heads") or n_heads),
                int(cfg.get("head_dim") or hidden // n_heads),
                bias=bool(cfg.get("attention_bias", False)), eps=eps, device=device, dtype=dtype,
                linear=linear)
        self.moe = int(cfg.get("num_experts") or 0) > 0
        self.mlp = (SparseMoE(hidden, int(cfg["num_experts"]), int(cfg["num_experts_per_tok"]),
                              int(cfg["moe_intermediate_size"]), int(cfg["shared_expert_intermediate_size"]),
                              bool(cfg.get("norm_topk_prob", True)), device, dtype, linear)
                    if self.moe else SwiGLU(hidden, int(cfg["intermediate_size"]), False, device, dtype, linear))
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps, device, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps, device, dtype)

    def hf_alternatives(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Other checkpoint names for parts of :meth:`hf_targets` entries (relative to
        ``model.layers.{i}.``): name -> (the target it fills part of, view). Today the
        per-expert and stacked-halves layouts of MoE experts."""
        if not self.moe:
            return {}
        return {"mlp." + name: ("mlp." + fused, view)
                for name, (fused, view) in self.mlp.hf_per_expert_targets().items()}

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint names (relative to ``model.layers.{i}.``) -> parameter views."""
        mixer, prefix = ((self.linear_attn, "linear_attn.") if self.layer_type == LINEAR
                         else (self.self_attn, "self_attn."))
        targets = {prefix + name: view for name, view in mixer.hf_targets().items()}
        if self.moe:
            targets.update({"mlp." + name: view for name, view in self.mlp.hf_targets().items()})
        else:
            inter = self.mlp.inter
            targets.update({
                "mlp.gate_proj.weight": self.mlp.gate_up_weight[:inter],
                "mlp.up_proj.weight": self.mlp.gate_up_weight[inter:],
                "mlp.down_proj.weight": self.mlp.down_weight,
            })
        targets.update({
            "input_layernorm.weight": self.input_layernorm.weight,
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight,
        })
        return targets


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
    ``kernels``: the engine's kernel options (``onednn`` picks the linear function, ``fla``
    lets the Gated DeltaNet layers use flash-linear-attention).
    """

    def __init__(self, config: Mapping[str, Any], device: torch.device | str | None = "cpu",
                 dtype: torch.dtype | None = torch.float32, kernels: KernelOptions | None = None) -> None:
        super().__init__()
        kernels = kernels or KernelOptions()
        self.linear = linear_kernel(device, dtype, kernels.onednn)
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
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, device, dtype, self.linear, kernels.fla)
                                    for t in self.layer_types)
        self.norm = ZeroCenteredRMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)), device, dtype)
        self.tied = bool(cfg["tie_word_embeddings"])
        self.lm_head_weight = self.embed_weight if self.tied else _param(
            self.vocab_size, hidden, device=device, dtype=dtype)

    # --- weights --------------------------------------------------------------------------------

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Text-model checkpoint names (after :func:`_local_name`) -> parameter views."""
        targets = {"embed_tokens.weight": self.embed_weight, "norm.weight": self.norm.weight}
        if not self.tied:
            targets["lm_head.weight"] = self.lm_head_weight
        for i, layer in enumerate(self.layers):
            targets.update({f"layers.{i}.{name}": view for name, view in layer.hf_targets().items()})
        return targets

    def hf_alternatives(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Other names (after :func:`_local_name`) that fill parts of a target: name ->
        (target, view); see :meth:`DecoderLayer.hf_alternatives`."""
        return {f"layers.{i}.{name}": (f"layers.{i}.{fused}", view)
                for i, layer in enumerate(self.layers)
                for name, (fused, view) in layer.hf_alternatives().items()}

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill the parameters from checkpoint tensors of either layout (text-only
        ``model.*`` or multimodal ``model.language_model.*``; vision and MTP ignored). MoE
        experts load from the fused (``mlp.experts.gate_up_proj``), the per-expert
        (``mlp.experts.{e}.gate_proj.weight``) or the stacked-halves
        (``mlp.experts.gate_proj``) layout; a fused weight counts as loaded once pieces
        covering all its elements were copied.

        Tensors may be on any device/dtype; they are copied into the parameters (which keep
        their device and dtype). When ``lm_head.weight`` is absent the output projection is
        tied to the embeddings. Raises ``KeyError`` naming the first missing weight,
        ``ValueError`` for a shape mismatch.
        """
        targets = self.hf_targets()
        alternatives = self.hf_alternatives()
        seen: set[str] = set()
        parts: dict[str, int] = {}  # fused target -> elements copied into it from pieces
        with torch.no_grad():
            for hf_name in tensors.keys():
                name = _local_name(hf_name)
                if not name:
                    continue
                dest = targets.get(name)
                if dest is None and name in alternatives:
                    fused, dest = alternatives[name]
                    parts[fused] = parts.get(fused, 0) + dest.numel()
                if dest is None:
                    continue
                tensor = tensors[hf_name]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor)
                seen.add(name)
        seen.update(fused for fused, n in parts.items() if n >= targets[fused].numel())
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
            mask = prefill_mask(start, n_new, None, x.device)
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

    def decode_step(self, token: torch.Tensor, pos: torch.Tensor, state: Qwen3_5State, span: int,
                    ops) -> torch.Tensor:
        """One decode token with its position as a device tensor, capturable in a CUDA graph
        (see :mod:`redlite.engine.cuda_graphs`; the contract of
        :meth:`redlite.models.llama.LlamaModel.decode_step`): no host reads, no allocation
        that depends on the position; the conv/recurrent states are updated in place and the
        token's keys/values written at ``pos``; ``state.n_past`` is left to the caller.

        Per Gated DeltaNet layer: ``norm_linear`` (input norm + in_proj), ``gdn_step``
        (conv, delta rule, gated norm), ``linear_residual`` (out_proj + residual); per full
        attention layer ``norm_linear`` (qkv), ``gated_rope_attend``, ``linear_residual``;
        then the MLP as in the Llama family (``moe`` for a mixture-of-experts MLP: router with
        its input norm, the chosen experts and the gated shared expert), all norms
        zero-centred. Returns float32 logits [1, vocab] (the same as :meth:`forward` up to
        rounding).
        """
        x = F.embedding(token, self.embed_weight)  # the residual stream, updated in place
        cos, sin = self.rotary.get(0, state.max_tokens, x.device, x.dtype)
        keys, values = state.cache.keys, state.cache.values
        for i, layer in enumerate(self.layers):
            norm = layer.input_layernorm
            if layer.layer_type == LINEAR:
                mixer = layer.linear_attn
                proj = ops.norm_linear(x, norm.weight, norm.eps, mixer.in_proj_weight, None, zero_centered=True)
                out = ops.gdn_step(proj, state.conv[i], state.recurrent[i], mixer)
                ops.linear_residual(out, mixer.out_weight, None, x)
            else:
                attn, slot = layer.self_attn, state.kv_slot[i]
                qkv = ops.norm_linear(x, norm.weight, norm.eps, attn.qkv_weight, attn.qkv_bias, zero_centered=True)
                out = ops.gated_rope_attend(qkv, pos, cos, sin, attn.q_norm_weight, attn.k_norm_weight, attn.eps,
                                            keys[slot], values[slot], attn.n_heads, attn.n_kv_heads,
                                            attn.head_dim, span)
                ops.linear_residual(out, attn.o_weight, attn.o_bias, x)
            mlp_residual(ops, x, layer)
        return ops.norm_linear(x, self.norm.weight, self.norm.eps, self.lm_head_weight, None, out_float32=True,
                               zero_centered=True)


def mlp_residual(ops, x: torch.Tensor, layer, moe=None) -> None:
    """``x += mlp(post_attention_layernorm(x))`` in place for the decode rows ``x`` [B, H]
    (model dtype) of decoder ``layer``, through the decode ``ops`` (capturable): the dense
    SwiGLU (``norm_gate_up``, ``linear_residual``), or the mixture-of-experts block through
    ``moe(ops, x, post_norm, mlp)`` (default: ``ops.moe`` on one row)."""
    post, mlp = layer.post_attention_layernorm, layer.mlp
    if layer.moe:
        if moe is None:
            ops.moe(x, post.weight, post.eps, mlp, zero_centered=True)
        else:
            moe(ops, x, post, mlp)
        return
    act = ops.norm_gate_up(x, post.weight, post.eps, mlp.gate_up_weight, mlp.gate_up_bias, mlp.inter,
                           zero_centered=True)
    ops.linear_residual(act, mlp.down_weight, mlp.down_bias, x)


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
