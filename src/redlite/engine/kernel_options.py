"""Which kernels the torch engine uses: one options object, built from the command line
(:func:`add_kernel_options`, :func:`kernel_options_from_args`) and passed down to the engine,
which hands each layer the plain parameter it needs. The defaults are the fast paths; each
switch exists to compare against, or to step around, one of them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


#: ``--kv-dtype`` choices (see :mod:`redlite.engine.kv_dtype`)
KV_DTYPES = ("auto", "float32", "float16")


@dataclass(frozen=True)
class KernelOptions:
    """``cuda_graphs``: decode through captured CUDA graphs on CUDA (False: eager decode).
    ``triton``: the fused Triton decode kernels on CUDA (False: torch ops in the decode step).
    ``pdl``: programmatic dependent launch of the Triton kernels, 0 off, 1 or 2 (see
    :func:`redlite.layers.triton_gemv.pdl_sync`); None: the kernels' default where the GPU
    supports it. ``gemv_configs``: a JSON file of tuned GEMV launch settings (written by
    ``bench/gpu_tune.py --gemv --save``); None: the built-in table. ``fla``: the
    flash-linear-attention kernels for Gated DeltaNet layers on CUDA when the package imports.
    ``onednn``: oneDNN's linear op on CPU where it probes correct (False: ``F.linear``).
    ``batch_invariant``: with the Triton ops, a batched decode step (``--parallel``) computes
    each sequence's row bitwise as that sequence's step alone (its products through
    :mod:`redlite.layers.triton_gemv_rows`, its attention sliced as alone), so the same request
    and seed give the same output whatever else runs; False: cuBLAS products, faster at large
    batches, equal to the lone step only up to rounding.
    ``heap_reuse``: on CPU, freed buffers stay in the C heap for the next ones (see
    :func:`redlite.engine.heap.reuse_freed_memory`; False: glibc's defaults).
    ``chunk_graphs``: with ``cuda_graphs``, prefills of 2 to 64 tokens of a Llama-family model
    replay a captured graph per chunk length (:mod:`redlite.engine.chunk_graphs`; False: an
    eager forward pass, or token by token through the decode graph).
    ``kv_dtype``: what the KV cache holds, ``"auto"`` (the model's dtype), ``"float32"`` or
    ``"float16"`` (see :mod:`redlite.engine.kv_dtype`)."""

    cuda_graphs: bool = True
    triton: bool = True
    pdl: int | None = None
    gemv_configs: str | None = None
    fla: bool = True
    onednn: bool = True
    batch_invariant: bool = False
    heap_reuse: bool = True
    kv_dtype: str = "auto"
    chunk_graphs: bool = True

    def __post_init__(self) -> None:
        if self.pdl not in (None, 0, 1, 2):
            raise ValueError(f"pdl must be 0, 1 or 2, got {self.pdl!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")


def add_kernel_options(parser: argparse.ArgumentParser) -> None:
    """The command-line switches of :class:`KernelOptions`."""
    group = parser.add_argument_group("kernels (defaults are the fast paths)")
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="on CUDA, decode through captured CUDA graphs (--no-cuda-graphs: eager)")
    group.add_argument("--chunk-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="on CUDA, prefills of 2-64 tokens (a turn's new tail) replay a captured "
                            "graph per chunk length (Llama family; --no-chunk-graphs: eager)")
    group.add_argument("--triton", action=argparse.BooleanOptionalAction, default=True,
                       help="on CUDA, the fused Triton decode kernels (--no-triton: torch ops)")
    group.add_argument("--pdl", type=int, choices=[0, 1, 2], default=None,
                       help="programmatic dependent launch of the Triton kernels: 0 off, 1 "
                            "wait-then-trigger, 2 trigger-then-wait (default: 1 where the GPU "
                            "has it)")
    group.add_argument("--gemv-configs", metavar="PATH", default=None,
                       help="JSON of tuned GEMV launch settings (bench/gpu_tune.py --gemv --save)")
    group.add_argument("--fla", action=argparse.BooleanOptionalAction, default=True,
                       help="on CUDA, flash-linear-attention kernels for Gated DeltaNet layers "
                            "when the package is installed")
    group.add_argument("--onednn", action=argparse.BooleanOptionalAction, default=True,
                       help="on CPU, oneDNN's linear op where it probes correct (--no-onednn: F.linear)")
    group.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                       help="on CUDA with --parallel, every sequence in a batched decode step gets "
                            "bitwise the logits it gets alone (same seed, same output whatever else "
                            "runs); slower than cuBLAS products at large batches")
    group.add_argument("--heap-reuse", action=argparse.BooleanOptionalAction, default=True,
                       help="on CPU, keep freed buffers in the C heap for the next ones instead of "
                            "mapping each large one afresh (prefill faster; resident memory stays at "
                            "its peak; --no-heap-reuse: glibc's defaults)")
    group.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                       help="what the KV cache holds (auto: the model's dtype). float16 on CPU "
                            "under a GGUF Llama-family model: half the cache memory (and of every "
                            "parked conversation and session file), decode at about float32's "
                            "speed; the logits move slightly (a greedy near-tie can flip)")


def kernel_options_from_args(args: argparse.Namespace) -> KernelOptions:
    """The :class:`KernelOptions` of parsed command-line options (defaults for absent ones)."""
    default = KernelOptions()
    return KernelOptions(**{name: getattr(args, name, getattr(default, name))
                            for name in KernelOptions.__dataclass_fields__})
