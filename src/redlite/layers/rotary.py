"""Rotary position embedding (RoPE) in the Hugging Face "rotate half" layout.

Frequencies follow Hugging Face ``ROPE_INIT_FUNCTIONS`` for the types ``default``,
``linear``, ``llama3`` and ``yarn``; ``rope_parameters(config)`` reads both the
transformers-5 ``rope_parameters`` dict and the older ``rope_theta`` + ``rope_scaling``.
Partial rotary embedding (only the first ``rotary_dim`` of ``head_dim`` features rotate)
is supported through ``rotary_dim``.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Normalised RoPE settings of a ``config.json`` dict: always has ``rope_type`` (str),
    ``rope_theta`` (float) and ``partial_rotary_factor`` (float, default 1.0), plus the
    scaling fields of the type (``factor``, ...)."""
    params = config.get("rope_parameters")
    params = dict(params) if isinstance(params, dict) else dict(config.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_theta"] = float(params["rope_theta"])
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(rotary_dim: int, params: dict[str, Any],
                    max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32 CPU tensor ``[rotary_dim // 2]``) and the attention
    scaling factor (float, multiplies cos and sin) for ``params`` from
    :func:`rope_parameters`. Raises ``ValueError`` for an unsupported ``rope_type``."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, base, params, max_position_embeddings)
    factor = float(params["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        old_len = float(params["original_max_position_embeddings"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_type {kind!r}")


def _yarn(dim: int, base: float, params: dict[str, Any],
          max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryTable:
    """Cached cos/sin tables of one rotary embedding, grown on demand.

    ``get(start, end)`` returns ``(cos, sin_signed)``, each ``[end - start, 1, rotary_dim]``
    in the requested dtype: views of the cache, computed once in float32 as Hugging Face
    does (``freqs = position * inv_freq``, duplicated over both halves, times the attention
    scaling). ``sin_signed`` has its first half negated, for :func:`apply_rotary`.
    """

    def __init__(self, rotary_dim: int, inv_freq: torch.Tensor, scaling: float = 1.0):
        self.rotary_dim = rotary_dim
        self.inv_freq = inv_freq.float().cpu()
        self.scaling = float(scaling)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], head_dim: int,
                    partial_rotary_factor: float | None = None) -> "RotaryTable":
        """Table for a ``config.json`` dict; ``partial_rotary_factor`` overrides the config's."""
        params = rope_parameters(config)
        fraction = params["partial_rotary_factor"] if partial_rotary_factor is None else partial_rotary_factor
        rotary_dim = int(head_dim * float(fraction))
        inv_freq, scaling = inv_frequencies(rotary_dim, params, config.get("max_position_embeddings"))
        return cls(rotary_dim, inv_freq, scaling)

    def _build(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        positions = torch.arange(length, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        self._cos = torch.cat((cos, cos), -1)[:, None, :].to(device=device, dtype=dtype)
        self._sin = torch.cat((-sin, sin), -1)[:, None, :].to(device=device, dtype=dtype)

    def get(self, start: int, end: int, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions ``start .. end - 1``: two ``[T, 1, rotary_dim]``."""
        cached = self._cos
        if (cached is None or cached.shape[0] < end or cached.dtype != dtype
                or cached.device != torch.device(device)):
            length = max(end, 256 if cached is None else 2 * cached.shape[0])
            self._build(length, torch.device(device), dtype)
        return self._cos[start:end], self._sin[start:end]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([T, heads, head_dim]) by the tables from :meth:`RotaryTable.get`
    ([T, 1, rotary_dim], x's dtype). Only the first ``rotary_dim`` features rotate (the
    rest pass through). Returns a new tensor of ``x``'s shape and dtype."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        swapped = x.unflatten(-1, (2, rotary_dim // 2)).flip(-2).flatten(-2)
        return torch.addcmul(x * cos, swapped, sin_signed)
    head = x[..., :rotary_dim]
    swapped = head.unflatten(-1, (2, rotary_dim // 2)).flip(-2).flatten(-2)
    return torch.cat((torch.addcmul(head * cos, swapped, sin_signed), x[..., rotary_dim:]), -1)
