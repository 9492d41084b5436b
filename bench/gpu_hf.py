"""Helpers of bench/gpu.py: the Qwen3-8B-shaped config, building the Hugging Face model with
random weights directly on the device, timing its ``generate`` (and the side-by-side
section), the stub tokenizer and the second-turn TTFT section.

Decode speed is read per step: a logits processor stamps the time (after a device
synchronisation) each time ``generate`` picks a token, so one call gives the prefill time
(first stamp) and the decode rate ((n - 1) steps between the first and the last stamp), and
the compiled static-cache mode is timed on the shapes it was compiled for.
"""

from __future__ import annotations

import time
import traceback

import torch

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def hf_config(n_layers: int):
    """transformers ``Qwen3Config`` of Qwen3-8B's shape with ``n_layers`` layers and a
    131072-token position limit (the 64k TTFT needs more than the real model's 40960)."""
    import transformers

    config = transformers.Qwen3Config(**dict(QWEN3_8B, num_hidden_layers=n_layers))
    config._attn_implementation = "sdpa"
    config.eos_token_id = None
    config.pad_token_id = 0
    return config


def build_hf(config, device: torch.device, dtype: torch.dtype, model_class=None):
    """``model_class`` (default ``Qwen3ForCausalLM``) of ``config`` with transformers' random
    initialisation, built on ``device`` in ``dtype`` (no host copy of the weights)."""
    import transformers

    model_class = model_class or transformers.Qwen3ForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def say(*parts) -> None:
    print(*parts, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepClock:
    """A logits processor that records the time (after a device sync) of every step."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


HF_MODES = {
    "dynamic cache (default)": {},
    "static cache, eager": {"cache_implementation": "static", "disable_compile": True},
    "static cache + torch.compile (auto)": {"cache_implementation": "static"},
}


def hf_generate_rate(model, prompt: torch.Tensor, n_new: int, mode: str, warmups: int = 1) -> dict:
    """Greedy ``generate`` of ``n_new`` tokens after ``prompt`` ([1, T] ids on the model's
    device) in ``mode`` (a key of ``HF_MODES``). Returns prefill seconds, decode tokens/s,
    warm-up seconds (compilation included) and the generated ids."""
    from transformers import LogitsProcessorList

    device = prompt.device
    kwargs = dict(HF_MODES[mode], max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                  pad_token_id=0, attention_mask=torch.ones_like(prompt))
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(warmups):
            model.generate(prompt, **kwargs)
        sync(device)
        warm_s = time.perf_counter() - started
        clock = _StepClock(device)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(prompt, logits_processor=LogitsProcessorList([clock]), **kwargs)
    steps = clock.times
    rate = (len(steps) - 1) / (steps[-1] - steps[0]) if len(steps) > 1 else float("nan")
    return {"mode": mode, "prefill_s": steps[0] - t0, "decode_tok_s": rate, "warmup_s": warm_s,
            "tokens": out[0, prompt.shape[1]:].tolist()}


def engine_generate_rate(engine, prompt_ids: list[int], n_new: int) -> dict:
    """The same measurement on a redlite engine: prefill, then greedy decode with the sampled
    id read on the host every step (as the server does)."""
    device = engine.device
    engine.reset()
    sync(device)
    t0 = time.perf_counter()
    logits = engine.prefill(prompt_ids)
    tokens, times = [], []
    for i in range(n_new):
        tokens.append(int(torch.argmax(logits)))
        times.append(time.perf_counter())
        if i + 1 < n_new:
            logits = engine.decode(tokens[-1])
    rate = (n_new - 1) / (times[-1] - times[0]) if n_new > 1 else float("nan")
    return {"prefill_s": times[0] - t0, "decode_tok_s": rate, "tokens": tokens}


class StubTokenizer:
    """The two members :class:`redlite.core.generation.Generator` uses: no end-of-turn id
    (random weights never stop early) and a decoder that turns every id into text."""

    eos_token_ids = frozenset()

    class _Decoder:
        def push(self, token: int) -> str:
            return f"<{token}>"

        def flush(self) -> str:
            return ""

    def incremental_decoder(self):
        return self._Decoder()


def first_token_s(generator, prompt: list[int]) -> tuple[float, object]:
    """(seconds to the first streamed text, the GenerationResult) of one greedy 1-token request."""
    from redlite.core.generation_request import GenerationRequest
    from redlite.engine.base import SamplingParams

    request = GenerationRequest(prompt_ids=prompt, max_tokens=1, sampling=SamplingParams(temperature=0.0))
    t0 = time.perf_counter()
    run = generator.run(request)
    next(run)  # the first streamed text: the first token was sampled (its id read on the host)
    elapsed = time.perf_counter() - t0
    result = [item for item in run][-1]
    return elapsed, result


def ttft(R: dict, engine, contexts, device, suffix_len=64, gen_tokens=8):
    """Second-turn TTFT rows into ``R["ttft"]`` (see bench/gpu.py's docstring)."""
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GenerationRequest, GeneratorSettings
    from redlite.engine.base import SamplingParams

    rng = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, engine.vocab_size, (n,), generator=rng).tolist()  # noqa: E731
    for ctx in contexts:
        engine.reset()
        gen = Generator(engine, StubTokenizer(), GeneratorSettings(reuse=True))
        request = GenerationRequest(prompt_ids=rand(ctx), max_tokens=gen_tokens,
                                    sampling=SamplingParams(temperature=0.0))
        for _ in gen.run(request):
            pass
        held = list(gen.held_ids)
        reuse, ideal = [], []
        for _ in range(3):
            suffix = rand(suffix_len)
            engine.rewind(len(held))
            gen.held_ids = list(held)
            seconds, result = first_token_s(gen, held + suffix)
            assert result.cached_tokens == len(held), (result.cached_tokens, len(held))
            reuse.append(seconds)
            engine.rewind(len(held))
            sync(device)
            t0 = time.perf_counter()
            logits = engine.prefill(suffix)
            logits = engine.decode(int(torch.argmax(logits)))
            int(torch.argmax(logits))
            ideal.append(time.perf_counter() - t0)
        engine.rewind(len(held))
        cold = Generator(engine, StubTokenizer(), GeneratorSettings(reuse=False))
        cold.held_ids = list(held)
        no_reuse, result = first_token_s(cold, held + rand(suffix_len))
        assert result.cached_tokens == 0
        row = {"context": len(held), "suffix": suffix_len, "reuse_ms": 1e3 * min(reuse),
               "ideal_ms": 1e3 * min(ideal), "no_reuse_ms": 1e3 * no_reuse}
        row["reuse_over_ideal"] = row["reuse_ms"] / row["ideal_ms"]
        row["no_reuse_over_reuse"] = row["no_reuse_ms"] / row["reuse_ms"]
        R["ttft"].append(row)
        say(f"ttft @ {len(held):>6} held + {suffix_len}: reuse {row['reuse_ms']:8.1f} ms  ideal "
            f"{row['ideal_ms']:8.1f} ms ({row['reuse_over_ideal']:.2f}x)  no reuse "
            f"{row['no_reuse_ms']:9.1f} ms ({row['no_reuse_over_reuse']:.0f}x slower)")
    engine.reset()


def transformers_side_by_side(R: dict, hf, engine, device, ctx, n_new, modes, write=lambda: None):
    """Decode tokens/s of redlite and of transformers' ``generate`` modes into ``R["hf"]``."""
    prompt = torch.randint(0, engine.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(9))
    ours = engine_generate_rate(engine, prompt[0].tolist(), n_new)
    ours_row = {"engine": f"redlite ({engine.decode_path})", "decode_tok_s": ours["decode_tok_s"],
                "prefill_s": ours["prefill_s"]}
    R["hf"].append(ours_row)
    say(f"redlite: decode {ours['decode_tok_s']:.1f} tok/s, prefill {ours['prefill_s'] * 1e3:.1f} ms")
    for mode in modes:
        try:
            got = hf_generate_rate(hf, prompt.to(device), n_new, mode)
        except Exception as error:  # noqa: BLE001 - a mode that does not work here
            traceback.print_exc()
            R["hf"].append({"engine": f"transformers, {mode}", "error": f"{type(error).__name__}: {error}"})
            say(f"transformers {mode}: failed ({type(error).__name__})")
            continue
        same = next((i for i, (a, b) in enumerate(zip(got["tokens"], ours["tokens"])) if a != b),
                    min(len(got["tokens"]), len(ours["tokens"])))
        R["hf"].append({"engine": f"transformers, {mode}", "decode_tok_s": got["decode_tok_s"],
                        "prefill_s": got["prefill_s"], "warmup_s": got["warmup_s"], "same_first_tokens": same})
        say(f"transformers {mode}: decode {got['decode_tok_s']:.1f} tok/s, prefill "
            f"{got['prefill_s'] * 1e3:.1f} ms (warm-up {got['warmup_s']:.1f} s; first {same} greedy ids equal ours)")
        write()
    best = max((r["decode_tok_s"] for r in R["hf"][1:] if "decode_tok_s" in r), default=None)
    if best:
        R["hf_ratio"] = ours["decode_tok_s"] / best
        say(f"redlite / best transformers decode: {R['hf_ratio']:.2f}x")
