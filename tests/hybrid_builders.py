"""Shared builders of the Qwen3.5 hybrid and MoE decode tests: random weights, token ids, the
Triton check-script runner, a logits comparison and the fork-versus-cold greedy run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parent.parent / "src")


def randomize(model, seed: int = 0, router_scale: float | None = None):
    """Fill ``model``'s parameters with seeded random values that keep the recurrent layers
    stable (``A_log`` from log-uniform decays); ``router_scale``: the std of MoE router weights
    (None: as any other weight). Returns the model in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                value = torch.empty(p.shape).uniform_(0.005, 1.0, generator=gen).log()
            elif "norm" in name or name.endswith("dt_bias"):
                value = 0.3 * torch.randn(p.shape, generator=gen)
            elif router_scale is not None and name.endswith("gates_weight"):
                value = router_scale * torch.randn(p.shape, generator=gen)
            else:
                value = 0.15 * torch.randn(p.shape, generator=gen)
            p.copy_(value)
    return model.eval()


def random_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    """``n`` seeded random token ids in ``[0, vocab_size)``."""
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_check_script(script: Path, device: str, interpret: bool) -> subprocess.CompletedProcess:
    """Run a Triton kernel check script on ``device`` (in Triton's interpreter when
    ``interpret``) with ``src`` on the path; 600 s timeout."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(script), device], env=env, capture_output=True, text=True,
                          timeout=600)


def assert_logits_close(want, got, tol: float) -> None:
    """Every pair of logits within ``tol`` relative to the larger of 1 and ``want``'s max."""
    for i, (a, b) in enumerate(zip(want, got)):
        a, b = a.float().cpu(), b.float().cpu()
        err = (a - b).abs().max().item()
        assert err < tol * max(1.0, a.abs().max().item()), (i, err)


def fork_and_cold(engine, prefix, branch, fork, n: int = 12):
    """Greedy ``n`` tokens after ``fork`` fed on a checkpoint restore (taken after ``prefix``,
    before ``branch`` was decoded), and the same from a cold ``prefix`` + ``fork``. Returns
    ``(warm, cold, checkpoint)``; the engine's ``decode_path`` must be a graph one (asserted)."""
    def greedy(logits):
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = engine.decode(out[-1])
        return out

    checkpoint = engine.take_checkpoint(engine.prefill(prefix))
    greedy(engine.prefill(branch))
    engine.restore_checkpoint(checkpoint)
    warm = greedy(engine.prefill(fork))
    assert engine.decode_path.startswith("graph/"), engine.decode_path
    engine.reset()
    engine.prefill(prefix)
    return warm, greedy(engine.prefill(fork)), checkpoint
