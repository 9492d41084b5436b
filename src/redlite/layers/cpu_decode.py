"""A Llama-family decode token on CPU in one C call (``decode_step`` in
``redlite/kernels/decode_step.c``), instead of ~20 torch ops per layer.

Per token, the eager path dispatches some 600 small torch ops for a 30-layer model (norms,
rotary, cache writes, attention, residual adds); on a 2-core CPU that costs as much as the
matrix products themselves. :class:`FusedDecode` hands the whole step to C: the same float32
arithmetic as the torch layers (up to the order of float32 additions), the products through the
quantized kernels on the activations chosen (16-bit by default, see
:mod:`redlite.layers.quant_weight`; F32 rows for dense weights), the KV cache (float32 or float16,
see :data:`CACHE_DTYPES`) written in place.

:meth:`FusedDecode.build` returns None unless every condition holds (CPU, float32 weights, the
kernel library loaded, sizes the kernels take, at least one quantized matrix unless
``require_quantized`` is False); the model then decodes through torch as before.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from redlite.kernels import native
from redlite.layers.quant_weight import DECODE_ACTIVATIONS

log = logging.getLogger("redlite.decode")

#: Activation forms of the quantized products (``acts`` in decode_step.c's ``model_t``).
ACTIVATIONS = {"float32": 0, "q8": 1, "q16": 2}
#: Cache dtypes the step reads and writes (``kv_half`` in ``model_t``).
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1}


def _cache_kind(caches: list[torch.Tensor]) -> int:
    """``kv_half`` for ``caches`` (all of one dtype, contiguous, on CPU); raises ValueError."""
    kinds = {CACHE_DTYPES.get(c.dtype) for c in caches}
    if None in kinds or len(kinds) != 1 or any(c.device.type != "cpu" or not c.is_contiguous() for c in caches):
        raise ValueError("the fused decode step needs contiguous CPU caches, all float32 or all float16")
    return kinds.pop()

class _Mat(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(native.Part)), ("n_parts", ctypes.c_int32), ("rows", ctypes.c_int32),
                ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Mat), ("o", _Mat), ("gate_up", _Mat), ("down", _Mat), ("attn_norm", ctypes.c_void_p),
                ("ffn_norm", ctypes.c_void_p), ("qk_norm", ctypes.c_void_p), ("window", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("n_heads", ctypes.c_int32), ("n_kv", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("rot_dim", ctypes.c_int32), ("vocab", ctypes.c_int32), ("eps", ctypes.c_float),
                ("qk_eps", ctypes.c_float), ("acts", ctypes.c_int32), ("kv_half", ctypes.c_int32),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p),
                ("lm_head", _Mat), ("embed", ctypes.POINTER(native.Part)), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p)]


class FusedDecode:
    """One decode token of a :class:`~redlite.models.llama.LlamaModel` in one C call; build
    with :meth:`build`. Holds pointers into the model's weights (kept alive here)."""

    def __init__(self, model, lib: ctypes.CDLL, activations: str = DECODE_ACTIVATIONS):
        self.lib, self.model = lib, model
        self._keep: list = []  # ctypes arrays and tensors the C structs point into
        spec = model.spec
        layers = (_Layer * spec.n_layers)()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.attn, layer.mlp
            layers[i] = _Layer(self._mat(attn.qkv_weight, attn.qkv_bias), self._mat(attn.o_weight, attn.o_bias),
                               self._mat(mlp.gate_up_weight, mlp.gate_up_bias), self._mat(mlp.down_weight, mlp.down_bias),
                               self._ptr(layer.input_norm.weight), self._ptr(layer.post_norm.weight),
                               self._ptr(attn.qk_norm_weight), int(attn.window or 0))
        self._keep.append(layers)
        self.struct = _Model(spec.n_layers, spec.hidden, spec.inter, spec.n_heads, spec.n_kv_heads, spec.head_dim,
                             model.rotary.rotary_dim, spec.vocab, spec.eps, model.layers[0].attn.norm_eps,
                             ACTIVATIONS[activations], 0, layers, self._ptr(model.norm.weight), self._mat(model.lm_head_weight, None),
                             ctypes.cast(self._parts(model.embed_weight), ctypes.POINTER(native.Part)),
                             None, None)

    @classmethod
    def build(cls, model, require_quantized: bool = True,
              activations: str = DECODE_ACTIVATIONS) -> "FusedDecode | None":
        """The fused step of ``model``, or None when it does not apply (see the module docstring).
        ``activations``: of the quantized products, as in
        :mod:`redlite.layers.quant_weight` (``"q16"``, ``"float32"``, ``"q8"``)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {sorted(ACTIVATIONS)}, got {activations!r}")
        spec = model.spec
        matrices = [model.embed_weight, model.lm_head_weight]
        for layer in model.layers:
            matrices += [layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight]
        quantized = [getattr(m, "is_quantized", False) for m in matrices]
        dense_ok = all(q or (m.device.type == "cpu" and m.dtype == torch.float32) for m, q in zip(matrices, quantized))
        sizes_ok = all(n % 32 == 0 for n in (spec.hidden, spec.inter, spec.n_heads * spec.head_dim))
        if (not dense_ok or not sizes_ok or model.norm.weight.dtype != torch.float32
                or model.norm.weight.device.type != "cpu" or (require_quantized and not any(quantized))):
            return None
        lib = native.library()
        if lib is None:
            return None
        step = cls(model, lib, activations)
        log.info("decode: one fused C step per token (%d layers, %s activations)", spec.n_layers, activations)
        return step

    def __call__(self, token: int, state) -> torch.Tensor:
        """Logits float32 [1, vocab] of ``token`` fed at ``state.n_past`` (written into the
        cache; ``state.n_past`` is left to the caller)."""
        cache = state.cache.data
        self.struct.kv_half = _cache_kind([cache])
        cos, sin = self.model.rotary.get(0, state.max_tokens)
        self.struct.cos, self.struct.sin = cos.data_ptr(), sin.data_ptr()
        logits = torch.empty(1, self.struct.vocab, dtype=torch.float32)
        self.lib.decode_step(ctypes.byref(self.struct), int(token), int(state.n_past), cache.data_ptr(),
                             state.max_tokens, logits.data_ptr())
        return logits

    def batch(self, tokens: list[int], states: list) -> torch.Tensor:
        """Logits float32 [B, vocab] of ``tokens[b]`` fed at ``states[b].n_past`` for B distinct
        states in one C call (``decode_batch``): each row bitwise equal to :meth:`__call__`
        of that token alone (every product treats its rows independently). The caches are
        written; the ``n_past`` values are left to the caller."""
        n = len(tokens)
        caches = [state.cache.data for state in states]
        self.struct.kv_half = _cache_kind(caches)
        cos, sin = self.model.rotary.get(0, max(state.max_tokens for state in states))
        self.struct.cos, self.struct.sin = cos.data_ptr(), sin.data_ptr()
        ids = torch.tensor(tokens, dtype=torch.int64)
        pos = torch.tensor([state.n_past for state in states], dtype=torch.int64)
        sizes = torch.tensor([state.max_tokens for state in states], dtype=torch.int64)
        pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
        logits = torch.empty(n, self.struct.vocab, dtype=torch.float32)
        self.lib.decode_batch(ctypes.byref(self.struct), n, ids.data_ptr(), pos.data_ptr(), pointers.data_ptr(),
                              sizes.data_ptr(), logits.data_ptr())
        return logits

    def _ptr(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach().float().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _parts(self, weight) -> ctypes.Array:
        if getattr(weight, "is_quantized", False):
            return weight.parts
        weight = weight.detach().contiguous()
        self._keep.append(weight)
        parts = (native.Part * 1)(native.Part(weight.data_ptr(), weight.shape[1] * 4, weight.shape[0], 0))
        self._keep.append(parts)
        return parts

    def _mat(self, weight, bias: torch.Tensor | None) -> _Mat:
        parts = self._parts(weight)
        rows = sum(p.rows for p in parts)
        return _Mat(ctypes.cast(parts, ctypes.POINTER(native.Part)), len(parts), rows, self._ptr(bias))
