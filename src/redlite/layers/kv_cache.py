"""Preallocated key/value cache of a stack of attention layers (one token sequence)."""

from __future__ import annotations

import torch

from redlite.engine.base import EngineError


class KVCache:
    """Keys and values of ``n_layers`` attention layers in one tensor
    ``data`` of shape ``[n_layers, 2, n_kv_heads, max_tokens, head_dim]``.

    ``keys[i]`` and ``values[i]`` are ``[n_kv_heads, max_tokens, head_dim]`` views of layer
    ``i``; tokens ``0 .. n - 1`` of a sequence holding ``n`` tokens are valid. The rest is
    uninitialised on the host (``torch.empty``: untouched pages cost no memory on most
    systems) and zeros on a GPU (device memory is committed either way): an attention that
    reads a fixed span past the held rows and masks them (a captured chunk step's) must not
    meet NaN bit patterns there, which a mask cannot remove from its products.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 device: torch.device | str, dtype: torch.dtype):
        self.max_tokens = int(max_tokens)
        make = torch.zeros if torch.device(device).type == "cuda" else torch.empty
        self.data = make(n_layers, 2, n_kv_heads, self.max_tokens, head_dim, device=device, dtype=dtype)
        self.keys = [self.data[i, 0] for i in range(n_layers)]
        self.values = [self.data[i, 1] for i in range(n_layers)]

    def nbytes(self, n_tokens: int) -> int:
        """Bytes held by the first ``n_tokens`` tokens (int)."""
        n_layers, _, heads, _, head_dim = self.data.shape
        return n_layers * 2 * heads * int(n_tokens) * head_dim * self.data.element_size()

    def export(self, n_tokens: int) -> torch.Tensor:
        """Contiguous CPU copy ``[n_layers, 2, n_kv_heads, n_tokens, head_dim]``."""
        part = self.data[:, :, :, :n_tokens]
        if self.data.device.type == "cpu":
            return part.clone(memory_format=torch.contiguous_format)
        return part.contiguous().cpu()

    def load(self, tensor: torch.Tensor, n_tokens: int) -> None:
        """Copy ``tensor`` (as from :meth:`export`, any device/dtype) into the first
        ``n_tokens`` tokens. Raises ``EngineError`` on a shape mismatch or overflow."""
        expected = self.data.shape[:3] + (n_tokens,) + self.data.shape[4:]
        if tuple(tensor.shape) != tuple(expected):
            raise EngineError(f"KV cache shape {tuple(tensor.shape)} != expected {tuple(expected)}")
        if n_tokens > self.max_tokens:
            raise EngineError(f"{n_tokens} tokens exceed the cache size {self.max_tokens}")
        part = self.data[:, :, :, :n_tokens]
        if tensor.data_ptr() == part.data_ptr() and tensor.stride() == part.stride() \
                and tensor.dtype == part.dtype and tensor.device == part.device:
            return  # filled in place (LlamaState.load_targets)
        part.copy_(tensor)
