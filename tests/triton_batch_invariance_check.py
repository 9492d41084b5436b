"""Checks that the batch-invariant batched decode step of the Qwen3.5 hybrid (dense and MoE)
gives each row bitwise the logits, and the state, of that sequence's lone ``decode_step``.

Usage: ``python tests/triton_batch_invariance_check.py cpu`` (with ``TRITON_INTERPRET=1``:
float32 only, the interpreter's bfloat16 matrix products being broken) or ``... cuda``
(float32 and bfloat16). Exits non-zero with a message on the first mismatch.
:func:`check_hybrid_rows` is also run by ``tests/test_batch_invariance_gpu.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_kernel_check  # noqa: E402,F401  (applies the interpreter patch)
from hybrid_builders import randomize  # noqa: E402

from redlite.layers.triton_ops import TritonDecodeOps  # noqa: E402
from redlite.models.batch_step import batch_decode_step  # noqa: E402
from redlite.models.qwen3_5 import Qwen3_5Model  # noqa: E402

# the batch at each step: every sequence, then sets of 3, 2 and 1 (other batch sizes, other rows)
SETS = ([0, 1, 2, 3], [3, 0, 2], [1, 2], [2], [0, 1, 2, 3])


def hybrid_model(config: dict, device, dtype) -> Qwen3_5Model:
    """A random Qwen3.5 model of ``config`` (MoE router weights scaled as the MoE tests do)."""
    moe = bool(config.get("num_experts"))
    return randomize(Qwen3_5Model(config, device="cpu", dtype=torch.float32), 0,
                     router_scale=1.5 if moe else None).to(device, dtype)


def check_hybrid_rows(model: Qwen3_5Model, device, dtype, lengths=(5, 11, 1, 23), ctx: int = 64) -> None:
    """Sequences prefilled to ``lengths`` (then copied: one set decoded alone, one batched) are
    decoded through :data:`SETS` with the batch-invariant Triton ops: each batched row's
    logits, and every state's KV rows and conv/recurrent states, bitwise the lone step's.
    Raises ``AssertionError`` naming the first mismatch."""
    head_dim, n_kv = model.text_config["head_dim"], model.text_config["num_key_value_heads"]
    ops = TritonDecodeOps(torch.device(device), n_kv, head_dim=head_dim, batch_invariant=True)
    assert ops.batch_invariant
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen).to(device) for n in lengths]
    alone, batched = ([model.new_state(ctx, device, dtype) for _ in lengths] for _ in range(2))
    for ids, a, b in zip(prompts, alone, batched):
        model(ids, a)
        _copy_state(a, b)
    for step, rows in enumerate(SETS):
        tokens = torch.randint(0, model.vocab_size, (len(rows),), generator=gen).to(device)
        pos = torch.tensor([alone[r].n_past for r in rows], device=device)
        want = [model.decode_step(tokens[j:j + 1], pos[j:j + 1], alone[r], ctx, ops) for j, r in enumerate(rows)]
        got = batch_decode_step(model, tokens, pos, [batched[r] for r in rows], ctx, ops)
        for j, r in enumerate(rows):
            alone[r].n_past += 1
            batched[r].n_past += 1
            name = f"{dtype} step {step} rows {rows} row {r}"
            assert torch.equal(got[j:j + 1], want[j]), f"{name}: logits differ by {(got[j] - want[j][0]).abs().max()}"
            _assert_same_state(name, alone[r], batched[r])


def _copy_state(a, b) -> None:
    b.cache.data.copy_(a.cache.data)
    for i in a.conv:
        b.conv[i].copy_(a.conv[i])
        b.recurrent[i].copy_(a.recurrent[i])
    b.n_past = a.n_past


def _assert_same_state(name: str, a, b) -> None:
    n = a.n_past
    assert torch.equal(a.cache.data[:, :, :, :n], b.cache.data[:, :, :, :n]), name + ": KV rows differ"
    for i in a.conv:
        assert torch.equal(a.conv[i], b.conv[i]), f"{name}: conv state {i} differs"
        assert torch.equal(a.recurrent[i], b.recurrent[i]), f"{name}: recurrent state {i} differs"


def main() -> None:
    from test_hybrid_decode import CONFIG as DENSE
    from test_moe_decode import CONFIG as MOE

    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    dtypes = (torch.float32,) if device.type == "cpu" else (torch.float32, torch.bfloat16)
    for name, config in (("dense", DENSE), ("moe", MOE)):
        for dtype in dtypes:
            with torch.inference_mode():
                check_hybrid_rows(hybrid_model(config, device, dtype), device, dtype)
            print(f"{device} {name} {dtype}: batched rows bitwise alone", flush=True)


if __name__ == "__main__":
    main()
