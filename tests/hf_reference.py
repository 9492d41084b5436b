"""Importing transformers' reference modelling for CPU parity tests."""

from __future__ import annotations

import importlib
import sys


def import_without_cuda_kernels(module: str) -> None:
    """Import ``module`` (a transformers modelling module) with its pure-PyTorch paths.

    transformers binds flash-linear-attention / causal-conv1d functions at import time when
    those packages are installed and then calls them for CPU tensors too, which fails; hide
    the packages while the module is imported so the CPU reference always runs.
    """
    blocked = ("fla", "causal_conv1d")
    hidden = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] in blocked}
    sys.modules.update(dict.fromkeys(blocked))
    try:
        importlib.import_module(module)
    finally:
        for name in blocked:
            del sys.modules[name]
        sys.modules.update(hidden)
