"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm).

Sliding-window attention (Mistral ``sliding_window``, Qwen2 ``use_sliding_window`` /
``layer_types``) is applied exactly, through the attention mask and, in decode, by reading
only the last ``window`` keys; the cache still holds every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from redlite.engine.base import EngineError
from redlite.engine.kernel_options import KernelOptions
from redlite.layers.attention import Attention, prefill_mask
from redlite.layers.kv_cache import KVCache
from redlite.layers.linear import assign_weight, embedding, linear_kernel
from redlite.layers.mlp import SwiGLU
from redlite.layers.norm import RMSNorm, rms_norm
from redlite.layers.rotary import RotaryTable
from redlite.models.base import CausalLM, ModelState


@dataclass(frozen=True)
class LlamaSpec:
    """Shape of a Llama-family model, read from a ``config.json`` dict."""

    hidden: int
    inter: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    eps: float
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: tuple  # per layer: sliding window in tokens, or None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LlamaSpec":
        kind = config.get("model_type", "llama")
        if config.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
        n_heads = int(config["num_attention_heads"])
        n_layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        attention_bias = bool(config.get("attention_bias", False))
        window = config.get("sliding_window")
        if "layer_types" in config and config["layer_types"]:
            windows = tuple(window if t == "sliding_attention" else None for t in config["layer_types"])
        elif kind in ("qwen2", "qwen3"):
            use = bool(config.get("use_sliding_window", False))
            first = int(config.get("max_window_layers", n_layers))
            windows = tuple(window if use and i >= first else None for i in range(n_layers))
        else:
            windows = (window,) * n_layers
        return cls(
            hidden=hidden,
            inter=int(config["intermediate_size"]),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(config.get("head_dim") or hidden // n_heads),
            vocab=int(config["vocab_size"]),
            max_positions=int(config.get("max_position_embeddings", 4096)),
            eps=float(config.get("rms_norm_eps", 1e-6)),
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or kind == "qwen2",
            o_bias=attention_bias and kind != "qwen2",
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=kind == "qwen3",
            windows=tuple(int(w) if w else None for w in windows),
        )


class LlamaState(ModelState):
    """KV caches of all layers (see :class:`~redlite.layers.kv_cache.KVCache`)."""

    can_truncate = True

    def __init__(self, spec: LlamaSpec, max_tokens: int, device, dtype: torch.dtype):
        self.cache = KVCache(spec.n_layers, spec.n_kv_heads, spec.head_dim, max_tokens, device, dtype)
        self.max_tokens = self.cache.max_tokens
        self.n_past = 0

    def buffer_addresses(self) -> tuple[int]:
        """Device address of the KV cache's ``data`` (allocated once, never moved: batched
        CUDA graphs read it from a table refilled before each replay)."""
        return (self.cache.data.data_ptr(),)

    def truncate(self, n_tokens: int) -> None:
        if not 0 <= n_tokens <= self.n_past:
            raise EngineError(f"cannot truncate {self.n_past} tokens to {n_tokens}")
        self.n_past = int(n_tokens)

    def nbytes(self) -> int:
        return self.cache.nbytes(self.n_past)

    def export(self, n_tokens: int | None = None) -> dict[str, torch.Tensor]:
        n = self.n_past if n_tokens is None else int(n_tokens)
        if not 0 <= n <= self.n_past:
            raise EngineError(f"cannot export {n} of {self.n_past} tokens")
        return {"kv": self.cache.export(n)}

    def load_targets(self, n_past: int) -> dict[str, torch.Tensor]:
        """``{"kv": view}``: where :meth:`load` of ``n_past`` tokens puts the cache (filling it
        in place, then ``load`` with that view, copies nothing). Drops the held tokens."""
        self.n_past = 0
        return {"kv": self.cache.data[:, :, :, :int(n_past)]}

    def load(self, tensors: Mapping[str, torch.Tensor], n_past: int) -> None:
        if set(tensors) != {"kv"}:
            raise EngineError(f"unexpected state tensors {sorted(tensors)}")
        self.cache.load(tensors["kv"], int(n_past))
        self.n_past = int(n_past)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, spec: LlamaSpec, window: int | None, device, dtype, linear=None):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden, spec.eps, device, dtype)
        self.attn = Attention(spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim,
                              qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm=spec.qk_norm,
                              norm_eps=spec.eps, window=window, device=device, dtype=dtype,
                              linear=linear)
        self.post_norm = RMSNorm(spec.hidden, spec.eps, device, dtype)
        self.mlp = SwiGLU(spec.hidden, spec.inter, spec.mlp_bias, device, dtype, linear)


class LlamaModel(CausalLM):
    """A Llama-family causal LM built from a ``config.json`` dict; weights are uninitialised
    until :meth:`load_hf_weights`. ``device``/``dtype``: where and how weights are held.
    ``kernels``: the engine's kernel options (its ``onednn`` picks the linear function)."""

    def __init__(self, config: dict[str, Any], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, kernels: KernelOptions | None = None):
        super().__init__()
        self.linear = linear_kernel(device, dtype, (kernels or KernelOptions()).onednn)
        self.config = dict(config)
        self.spec = spec = LlamaSpec.from_config(config)
        self.vocab_size, self.max_position_embeddings = spec.vocab, spec.max_positions
        self.embed_weight = nn.Parameter(torch.empty(spec.vocab, spec.hidden, device=device, dtype=dtype),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, w, device, dtype, self.linear) for w in spec.windows)
        self.norm = RMSNorm(spec.hidden, spec.eps, device, dtype)
        self.lm_head_weight = self.embed_weight if spec.tied else nn.Parameter(
            torch.empty(spec.vocab, spec.hidden, device=device, dtype=dtype), requires_grad=False)
        self.rotary = RotaryTable.from_config(config, spec.head_dim)
        self._windows = sorted({w for w in spec.windows}, key=lambda w: (w is not None, w or 0))
        self._fused_decode: object = None  # built at the first one-token forward (False: none)

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        spec = self.spec
        with torch.no_grad():
            assign_weight(self, "embed_weight", [tensors["model.embed_tokens.weight"]])
            self.norm.weight.copy_(tensors["model.norm.weight"])
            if spec.tied:
                if self.lm_head_weight is not self.embed_weight:
                    delattr(self, "lm_head_weight")
                    self.lm_head_weight = self.embed_weight
            else:
                assign_weight(self, "lm_head_weight", [tensors["lm_head.weight"]])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."

                def opt(name):
                    return tensors[name] if name in tensors else None

                layer.input_norm.weight.copy_(tensors[p + "input_layernorm.weight"])
                layer.post_norm.weight.copy_(tensors[p + "post_attention_layernorm.weight"])
                layer.attn.load(
                    tensors[a + "q_proj.weight"], tensors[a + "k_proj.weight"],
                    tensors[a + "v_proj.weight"], tensors[a + "o_proj.weight"],
                    biases=tuple(opt(a + f"{n}_proj.bias") for n in "qkvo"),
                    q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"))
                m = p + "mlp."
                layer.mlp.load(tensors[m + "gate_proj.weight"], tensors[m + "up_proj.weight"],
                               tensors[m + "down_proj.weight"], opt(m + "gate_proj.bias"),
                               opt(m + "up_proj.bias"), opt(m + "down_proj.bias"))

    def new_state(self, max_tokens: int, device: torch.device | str, dtype: torch.dtype,
                  kv_dtype: torch.dtype | None = None) -> LlamaState:
        """An empty state of ``max_tokens`` tokens; its cache holds ``kv_dtype`` (None:
        ``dtype``; see :mod:`redlite.engine.kv_dtype`)."""
        return LlamaState(self.spec, max_tokens, device, kv_dtype or dtype)

    def _masks(self, start: int, n_new: int, device) -> dict:
        """Attention mask per window size (None: causal from 0, or a single token)."""
        return {window: prefill_mask(start, n_new, window, device) for window in self._windows}

    def forward(self, input_ids: torch.Tensor, state: LlamaState, all_logits: bool = False) -> torch.Tensor:
        n_new = input_ids.shape[0]
        state.check_room(n_new)
        if n_new == 1 and self._fused() is not None:
            logits = self._fused_decode(int(input_ids[0]), state)
            state.n_past += 1
            return logits
        start = state.n_past
        x = embedding(input_ids, self.embed_weight)
        cos, sin = self.rotary.get(start, start + n_new, x.device, x.dtype)
        masks = self._masks(start, n_new, x.device)
        keys, values = state.cache.keys, state.cache.values
        for i, layer in enumerate(self.layers):
            attn = layer.attn
            x.add_(attn(layer.input_norm(x), start, cos, sin, keys[i], values[i], masks[attn.window]))
            x.add_(layer.mlp(layer.post_norm(x)))
        state.n_past = start + n_new
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, self.norm.weight, self.norm.eps)
        return self.linear(x, self.lm_head_weight, None).float()

    def _fused(self):
        """The one-call CPU decode step (:class:`~redlite.layers.cpu_decode.FusedDecode`) for a
        model with quantized weights on CPU, else None; decided once, after loading."""
        if self._fused_decode is None:
            from redlite.layers.cpu_decode import FusedDecode

            self._fused_decode = FusedDecode.build(self) or False
        return self._fused_decode or None

    def decode_step(self, token: torch.Tensor, pos: torch.Tensor, state: LlamaState, span: int,
                    ops) -> torch.Tensor:
        """One decode token with its position as a device tensor: no host reads, no
        allocation that depends on the position, so it can be captured in a CUDA graph
        (see :mod:`redlite.engine.cuda_graphs`) and replayed at any position.

        ``token``: LongTensor [1] (the id); ``pos``: LongTensor [1] (its position, the
        caller's ``state.n_past``), both on the model's device. ``span``: cache rows the
        attention may read (int, ``> pos``; ignored by ops with ``length_from_pos``).
        ``ops``: :class:`~redlite.layers.decode_ops.TorchDecodeOps` or a subclass. Writes
        the token's keys/values at ``pos`` but leaves ``state.n_past`` to the caller.
        Returns float32 logits [1, vocab] (the same as :meth:`forward` up to rounding).
        """
        x = embedding(token, self.embed_weight)  # the residual stream, updated in place
        cos, sin = self.rotary.get(0, state.max_tokens, x.device, x.dtype)
        keys, values = state.cache.keys, state.cache.values
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.attn, layer.mlp
            qkv = ops.norm_linear(x, layer.input_norm.weight, layer.input_norm.eps, attn.qkv_weight, attn.qkv_bias)
            out = attn.decode_attend(qkv, pos, cos, sin, keys[i], values[i], span, ops)
            ops.linear_residual(out, attn.o_weight, attn.o_bias, x)
            act = ops.norm_gate_up(x, layer.post_norm.weight, layer.post_norm.eps, mlp.gate_up_weight,
                                   mlp.gate_up_bias, mlp.inter)
            ops.linear_residual(act, mlp.down_weight, mlp.down_bias, x)
        return ops.norm_linear(x, self.norm.weight, self.norm.eps, self.lm_head_weight, None, out_float32=True)
