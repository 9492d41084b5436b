"""Kernel switches are command-line options passed down as one :class:`KernelOptions` object:
the parser fills it, the model and the engine take it, each layer gets a plain parameter, and
no library module reads an environment variable (the brief's configuration rule)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from redlite.cli import CACHE_DIR_ENV, build_parser
from redlite.engine.kernel_options import KernelOptions, kernel_options_from_args
from redlite.layers import linear as linear_module
from redlite.layers.decode_ops import TorchDecodeOps, decode_ops

SRC = Path(__file__).resolve().parent.parent / "src" / "redlite"
# the command line is where the process environment is read; CC is the C toolchain's own variable
ENV_READERS = {"cli.py", "kernels/native.py"}

TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True)


def _serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_the_fast_paths():
    assert kernel_options_from_args(_serve()) == KernelOptions()
    assert KernelOptions() == KernelOptions(cuda_graphs=True, triton=True, pdl=None,
                                            gemv_configs=None, fla=True, onednn=True, heap_reuse=True)


def test_every_switch_reaches_the_options_object():
    args = _serve("--no-cuda-graphs", "--no-triton", "--pdl", "2", "--gemv-configs", "tuned.json",
                  "--no-fla", "--no-onednn", "--no-heap-reuse")
    assert kernel_options_from_args(args) == KernelOptions(cuda_graphs=False, triton=False, pdl=2,
                                                           gemv_configs="tuned.json", fla=False,
                                                           onednn=False, heap_reuse=False)


def test_bad_pdl_is_refused():
    with pytest.raises(SystemExit):
        _serve("--pdl", "3")
    with pytest.raises(ValueError, match="pdl"):
        KernelOptions(pdl=3)


def test_onednn_off_gives_every_layer_f_linear():
    from redlite.models.llama import LlamaModel

    plain = linear_module.linear_kernel("cpu", torch.float32, onednn=False)
    off = LlamaModel(dict(TINY_LLAMA), "cpu", torch.float32, KernelOptions(onednn=False))
    holders = [m for m in off.modules() if hasattr(m, "linear")]
    assert len(holders) >= 5 and all(m.linear is plain for m in holders)
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(plain(x, w, None), F.linear(x, w))
    if linear_module._onednn_works(torch.float32):  # where oneDNN probes correct, the default uses it
        on = LlamaModel(dict(TINY_LLAMA), "cpu", torch.float32)
        assert all(m.linear is not plain for m in on.modules() if hasattr(m, "linear"))


def test_fla_off_reaches_the_gated_deltanet_layers():
    from redlite.layers.gated_deltanet import GatedDeltaNet

    on = GatedDeltaNet(32, 2, 2, 8, 8, device="cpu", dtype=torch.float32)
    off = GatedDeltaNet(32, 2, 2, 8, 8, device="cpu", dtype=torch.float32, fla=False)
    assert on.fla and not off.fla


def test_triton_off_gives_torch_decode_ops():
    ops = decode_ops("cpu", torch.float32, 64, 2, F.linear, triton=False)
    assert type(ops) is TorchDecodeOps


def test_cache_dir_option_and_its_default(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    assert _serve().cache_dir is None
    assert _serve("--cache-dir", str(tmp_path)).cache_dir == str(tmp_path)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env"))
    assert _serve().cache_dir == str(tmp_path / "env")
    from redlite.loading.gguf import default_cache_dir

    assert default_cache_dir() == Path.home() / ".cache" / "redlite"  # the library reads no variable


def _reads_environment(tree: ast.AST) -> bool:
    """True when a module touches ``os.environ`` / ``os.getenv`` (however imported)."""
    return any(isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
               or isinstance(node, ast.Name) and node.id in ("environ", "getenv")
               or isinstance(node, ast.alias) and node.name in ("environ", "getenv")
               for node in ast.walk(tree))


def test_no_library_module_reads_the_environment():
    readers = {path.relative_to(SRC).as_posix() for path in sorted(SRC.rglob("*.py"))
               if _reads_environment(ast.parse(path.read_text()))}
    assert readers <= ENV_READERS, f"environment read inside library code: {sorted(readers - ENV_READERS)}"
    assert _reads_environment(ast.parse("import os\nx = os.environ.get('A')"))
    assert _reads_environment(ast.parse("from os import getenv\nx = getenv('A')"))


_HEAP_PROBE = """
import resource, sys, torch
from redlite.engine.heap import reuse_freed_memory
if sys.argv[1] == "on":
    assert reuse_freed_memory()
faults = []
for _ in range(12):  # a 64 MB buffer, written, freed: a prefill chunk's activations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[-1])
"""


@pytest.mark.timeout(120)
def test_heap_reuse_keeps_freed_buffers_mapped():
    import os
    import subprocess
    import sys

    def faults(mode: str) -> int:
        env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
        done = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], env=env, capture_output=True,
                              text=True, timeout=100)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    assert faults("off") > 10000  # glibc maps each 64 MB buffer afresh: 16k pages fault in
    assert faults("on") < 1000  # the freed buffer's pages are reused
