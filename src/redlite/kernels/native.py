"""Our small C kernels, compiled on first use and loaded through ctypes.

The sources (``*.c`` next to this file) are built with the system C compiler
(``cc -O3 -mavx2 -mfma -mf16c -pthread``, one shared library) into
``<cache root>/kernels/<hash>.so``, where the hash covers the sources, the flags and the
compiler's version, so a build happens once per change (about 2 s) and is then reused.
The kernels run on their own thread pool (pool.c), sized to ``torch.get_num_threads()`` when
the library loads (:func:`set_threads` changes it). A fused decode step takes the threads
(:func:`claim_threads`): torch's own ops then run on one thread outside :func:`torch_threads`.

:func:`library` returns the loaded library, or None where it cannot be had (no compiler, a CPU
without AVX2/FMA/F16C, a failed build: the reason is logged once); callers then use their torch
fallback. :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("redlite.kernels")

SOURCES = ("qmatmul.c", "qmatvec.c", "qmatvec16.c", "qgemm16.c", "decode_step.c",
           "decode_attention.c", "pool.c")
HEADERS = ("gguf_blocks.h",)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-fPIC", "-shared", "-std=gnu11")
_reason: str | None = None
_claimed = 0  # all threads, once claim_threads() gave them to the pool (0: not claimed)


class Part(ctypes.Structure):
    """One row block of a stacked weight (``part_t`` in qmatmul.c): ``rows`` rows of
    ``row_bytes`` bytes in GGML format ``fmt``, at ``data``."""

    _fields_ = [("data", ctypes.c_void_p), ("row_bytes", ctypes.c_int64), ("rows", ctypes.c_int32),
                ("fmt", ctypes.c_int32)]


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_vnni512() -> bool:
    """True when the CPU has the AVX-512 subsets qgemm16.c is compiled for (F, BW, DQ, VL and
    VNNI): only then may ``qgemm_q16x`` be called."""
    return {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= _cpu_flags()


def has_amx_bf16() -> bool:
    """True when the CPU multiplies bfloat16 matrices in AMX tiles (torch's oneDNN takes them
    for bfloat16 ``linear``), the prefill form ``bf16`` of :mod:`redlite.layers.quant_weight`."""
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= _cpu_flags()


def _cache_dir() -> Path:
    from redlite.loading.gguf import default_cache_dir

    return default_cache_dir() / "kernels"


def _build(compiler: str) -> Path:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for name in (*SOURCES, *HEADERS):
        digest.update((here / name).read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update(version.encode())
    target = _cache_dir() / f"redlite-kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, "-o", tmp, *(str(here / n) for n in SOURCES), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same sources is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built CPU kernels %s", target)
    return target


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The kernel library (built when needed), or None when it cannot be used (see the module
    docstring); never raises."""
    global _reason
    import torch

    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if missing:
        _reason = f"CPU lacks {', '.join(sorted(missing))}"
    elif compiler is None:
        _reason = "no C compiler (cc) found"
    else:
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except Exception as err:  # noqa: BLE001 - any build/load trouble: torch fallback
            _reason = f"kernel build failed: {err}"
        else:
            _declare(lib)
            lib.set_threads(torch.get_num_threads())
            return lib
    log.warning("quantized CPU kernels unavailable (%s): quantized weights are dequantized by torch", _reason)
    return None


def set_threads(n: int) -> None:
    """Run the kernels on ``n`` threads in all (the calling one included); no-op without the
    library."""
    lib = library()
    if lib is not None:
        lib.set_threads(int(n))


def claim_threads() -> None:
    """Give the kernels' pool all threads (``torch.get_num_threads()`` at the first call) and
    torch's own ops one, outside :func:`torch_threads` (for this thread and those whose first
    torch op comes later). A torch op run on several threads leaves torch's OpenMP workers
    spinning for milliseconds afterwards, on the cores the pool's workers need for the next
    products; the per-token torch ops around a decode step (a logits copy, sampling) gain
    nothing from more threads."""
    global _claimed
    import torch

    if not _claimed:
        _claimed = torch.get_num_threads()
        set_threads(_claimed)
    torch.set_num_threads(1)


@contextlib.contextmanager
def torch_threads():
    """Inside: torch's ops on all threads (a prefill), back to one on leaving; does nothing
    unless :func:`claim_threads` was called."""
    import torch

    if _claimed <= 1:
        yield
        return
    torch.set_num_threads(_claimed)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def unavailable_reason() -> str | None:
    """Why :func:`library` returned None (None when it loaded or was not tried)."""
    return _reason


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64, vp = ctypes.POINTER(Part), ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.qmatvec.argtypes = [p, i, vp, i, i, vp, i64, i]
    lib.qmatvec.restype = None
    lib.qmatmul_q8x.argtypes = [p, i, vp, i, i, vp, i64]
    lib.qmatmul_q8x.restype = None
    lib.qmatvec_q16x.argtypes = [p, i, vp, i, i, vp, i64]
    lib.qmatvec_q16x.restype = None
    lib.q16_use_vnni.argtypes = [i]
    lib.q16_use_vnni.restype = i
    lib.decode_step.argtypes = [vp, i64, i64, vp, i64, vp]
    lib.decode_step.restype = None
    lib.decode_batch.argtypes = [vp, i, vp, vp, vp, vp, vp]
    lib.decode_batch.restype = None
    lib.dequant_parts.argtypes = [p, i, i, vp]
    lib.dequant_parts.restype = None
    lib.dequant_parts_bf16.argtypes = [p, i, i, vp]
    lib.dequant_parts_bf16.restype = None
    lib.qgemm_q16x.argtypes = [p, i, vp, i, i, vp, i64]
    lib.qgemm_q16x.restype = None
    lib.dequant_rows.argtypes = [p, vp, i64, i, vp]
    lib.dequant_rows.restype = None
    lib.quantize_q8.argtypes = [vp, i, vp]
    lib.quantize_q8.restype = None
    lib.block_bytes.argtypes = [i]
    lib.block_bytes.restype = i
    lib.block_values.argtypes = [i]
    lib.block_values.restype = i
    lib.set_threads.argtypes = [i]
    lib.set_threads.restype = None
    lib.get_threads.argtypes = []
    lib.get_threads.restype = i
