"""The C kernels' tests skip where ``native.library()`` is None: that must mean a machine without
AVX2/FMA/F16C or without a C compiler, never sources that fail to build."""

import os
import shutil

from redlite.kernels import native


def test_the_kernels_build_wherever_the_cpu_and_a_compiler_allow():
    usable_cpu = {"avx2", "fma", "f16c"} <= native._cpu_flags()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if usable_cpu and compiler:
        assert native.library() is not None, native.unavailable_reason()
    else:
        assert native.library() is None and native.unavailable_reason()
