"""``--kv-dtype float16``: a float16 KV cache under the bundled model's float32 weights (the fused
CPU decode step reads and writes it; prefill reads the same rounded rows): half the state's bytes,
a warm continuation equal to a cold one, snapshots and files of its own dtype only."""

from __future__ import annotations

import pytest
import torch

from redlite.core.session_entries import engine_dtype, expected_for
from redlite.core.session_file import SessionFileError
from redlite.core.session_format import FORMAT, VERSION, check_compatible
from redlite.engine.kernel_options import KernelOptions
from redlite.engine.torch_engine import TorchEngine
from redlite.kernels import native
from redlite.loading.bundled import bundled_model_path
from redlite.loading.gguf import resolve_model_dir
from redlite.loading.hf import load_hf_model
from redlite.loading.tokenizer import load_tokenizer
from redlite.models.llama import LlamaModel

pytestmark = [pytest.mark.model, pytest.mark.timeout(300),
              pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")]

HALF = KernelOptions(kv_dtype="float16")


@pytest.fixture(scope="module")
def bundled():
    model_dir = resolve_model_dir(bundled_model_path())
    model, _ = load_hf_model(model_dir, "cpu", torch.float32)
    return model, load_tokenizer(model_dir)


def _greedy(engine: TorchEngine, ids: list[int], n: int) -> list[int]:
    logits, out = engine.prefill(ids), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        if out[-1] == 2:  # <|im_end|>
            break
        logits = engine.decode(out[-1])
    return out


def test_the_cache_holds_float16_and_half_the_bytes(bundled) -> None:
    model, tokenizer = bundled
    wide = TorchEngine(model, ctx_size=256, device="cpu")
    half = TorchEngine(model, ctx_size=256, device="cpu", kernels=HALF)
    assert (wide.kv_dtype, half.kv_dtype) == (torch.float32, torch.float16)
    assert half.state.cache.data.dtype == torch.float16
    ids = tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}]).token_ids
    for engine in (wide, half):
        engine.prefill(ids)
    assert half.state_nbytes() * 2 == wide.state_nbytes()
    half.reset()
    assert "Paris" in tokenizer.decode(_greedy(half, ids, 24))


def test_warm_second_turn_equals_cold(bundled) -> None:
    """The second turn on the held state (the answer's rows written by the fused step) gives the
    tokens a cold prefill of the whole conversation (every row written by prefill) gives."""
    model, tokenizer = bundled
    warm = TorchEngine(model, ctx_size=512, device="cpu", kernels=HALF)
    cold = TorchEngine(model, ctx_size=512, device="cpu", kernels=HALF)
    turn = [{"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "Name a large river in Europe."}]
    first = tokenizer.render_chat(turn).token_ids
    answer = _greedy(warm, first, 24)
    follow = turn + [{"role": "assistant", "content": tokenizer.decode(answer)},
                     {"role": "user", "content": "How long is it?"}]
    ids = tokenizer.render_chat(follow).token_ids
    held = first + answer
    common = min(warm.n_past, next(i for i, (a, b) in enumerate(zip(ids, held + [-1] * len(ids))) if a != b))
    warm.rewind(common)
    assert common > len(first)
    assert _greedy(warm, ids[common:], 24) == _greedy(cold, ids, 24)


def test_snapshot_restores_and_files_of_another_cache_dtype_are_refused(bundled) -> None:
    model, tokenizer = bundled
    wide = TorchEngine(model, ctx_size=256, device="cpu")
    half = TorchEngine(model, ctx_size=256, device="cpu", kernels=HALF)
    ids = tokenizer.render_chat([{"role": "user", "content": "Say hello."}]).token_ids
    half.prefill(ids)
    snapshot = half.snapshot()
    assert snapshot.tensors["kv"].dtype == torch.float16
    want = half.decode(5)
    half.rewind(len(ids))
    other = TorchEngine(model, ctx_size=256, device="cpu", kernels=HALF)
    other.restore(snapshot)
    assert torch.equal(other.decode(5), want)
    assert (engine_dtype(wide), engine_dtype(half)) == ("float32", "float32+kv-float16")
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": wide.fingerprint(),
            "dtype": engine_dtype(wide), "tensor_format": "torch"}
    check_compatible(meta, expected_for(wide))
    with pytest.raises(SessionFileError) as refused:
        check_compatible(meta, expected_for(half))
    assert refused.value.reason == "dtype"


def test_float16_needs_the_fused_step() -> None:
    """A dense float32 model decodes through torch ops, which read a cache of the model's dtype:
    float16 is refused there, at start, with the reason."""
    config = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "max_position_embeddings": 64, "model_type": "llama"}
    model = LlamaModel(config).eval()
    assert TorchEngine(model, device="cpu", kernels=KernelOptions(kv_dtype="float32")).kv_dtype == torch.float32
    with pytest.raises(ValueError, match="fused CPU decode step"):
        TorchEngine(model, device="cpu", kernels=HALF)
    with pytest.raises(ValueError, match="kv_dtype"):
        KernelOptions(kv_dtype="int8")
    half_weights = LlamaModel(config).to(torch.float16).eval()  # float32 cache under float16 weights
    with pytest.raises(ValueError, match="float16 under float32 weights on CPU only"):
        TorchEngine(half_weights, device="cpu", kernels=KernelOptions(kv_dtype="float32"))
