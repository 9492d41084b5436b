"""Helpers of bench/gpu.py: the run's metadata and the markdown report of its results dict."""

from __future__ import annotations

import datetime
import platform
import re

import torch

NOTES = [
    "Random weights (transformers' initialisation) in Qwen3-8B's shape; redlite loads the "
    "transformers model's state_dict, so both engines run the same weights.",
    "Decode: the KV cache is filled with random values and n_past set directly (no long prefill); "
    "tok/s over the timed tokens with the greedy id read on the host every step; best of 2 runs.",
    "Decode bound = copy bandwidth / (weight bytes read per token + KV bytes at the mean context).",
    "Prefill FLOPs = 2 x layer matmul parameters per token + 2 x lm_head parameters (last position "
    "only) + causal attention 4 x heads x head_dim x P(P+1)/2 per layer.",
    "TTFT: time from Generator.run to the first streamed token (its id read on the host); ideal = "
    "prefill of the new tokens on the held state + one decode step; reuse and ideal best of 3, "
    "no reuse measured once.",
    "Equal leading greedy ids between the engines are informative only: with random weights the "
    "top logits are near ties that bfloat16 rounding differences (e.g. another attention kernel) flip.",
    "Decode-ops rows: the same 1k decode with other kernel choices: `triton` fused products without "
    "programmatic dependent launch, `+pdl1` with it, `-attn0` attention launched plainly (the "
    "default), `triton+cublas` cuBLAS products with separate norm/add/silu kernels.",
    "max_position_embeddings is 131072 (the real Qwen3-8B has 40960) so the 64k turn fits.",
]


def meta(device: torch.device, layers: int, quick: bool, out: str | None) -> dict:
    """Date, device, versions and the output file stem of one run."""
    date = datetime.date.today().isoformat()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()}-cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for package in ("transformers", "triton"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - not installed
            versions[package] = None
    return {"date": date, "device": name, "layers": layers, "quick": quick, "out": out,
            "versions": versions, "stem": f"gpu-{date}-{slug}{'-quick' if quick else ''}", "notes": NOTES}


def _f(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(r: dict) -> str:
    """The results as markdown tables (sections that did not run are left out)."""
    m = r["meta"]
    lines = [f"# redlite GPU benchmark, {m.get('date')}, {m.get('device')}", "",
             f"{m.get('layers')} layers of Qwen3-8B's shape, bfloat16; versions {m.get('versions')}"
             + (" (quick run)" if m.get("quick") else ""), ""]
    c = r.get("ceilings") or {}
    if c:
        lines += ["| ceiling | measured |", "| --- | --- |",
                  f"| device-to-device copy (read + write) | {c['copy_bw_Bps'] / 1e12:.3f} TB/s |",
                  f"| bf16 matmul {c['matmul_n']}^3 | {c['matmul_flops'] / 1e12:.1f} TFLOP/s |", ""]
    if r.get("checks"):
        k = r["checks"]
        lines += [f"Checks: prefill logits vs transformers relative error "
                  f"{k['prefill_vs_transformers_rel']:.2e}; graph vs eager decode {k['graph_vs_eager_decode_rel']:.2e}; "
                  f"decode path `{k['decode_path']}`.", ""]
    if r.get("decode"):
        lines += ["| decode context | tok/s | bound tok/s | GB read/token | % of bound |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {d['context']} | {d['tok_s']:.1f} | {d['bound_tok_s']:.1f} | {d['bytes_per_token'] / 1e9:.2f} "
                  f"| {d['pct_of_bound']:.1f}% |" for d in r["decode"]]
        if r.get("decode_eager"):
            e = r["decode_eager"]
            lines += [f"| {e['context']} (eager, no graph) | {e['tok_s']:.1f} | | | |"]
        for v in r.get("decode_variants") or []:
            lines += [f"| {v['context']} (decode ops `{v['ops']}`) | {v['tok_s']:.1f} | | | |"]
        lines += [""]
    if r.get("prefill"):
        lines += ["| prefill tokens | tok/s | ms | TFLOP/s | % of matmul peak |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {p['tokens']} | {p['tok_s']:.0f} | {p['seconds'] * 1e3:.1f} | {p['tflops']:.1f} "
                  f"| {_f(p['pct_of_matmul_peak'], '.1f')}% |" for p in r["prefill"]]
        lines += [""]
    if r.get("ttft"):
        lines += ["| 2nd-turn TTFT, held + new | reuse ms | ideal ms | reuse / ideal | no reuse ms | no reuse / reuse |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {t['context']} + {t['suffix']} | {t['reuse_ms']:.1f} | {t['ideal_ms']:.1f} | "
                  f"{t['reuse_over_ideal']:.2f}x | {t['no_reuse_ms']:.1f} | {t['no_reuse_over_reuse']:.1f}x |"
                  for t in r["ttft"]]
        lines += [""]
    if r.get("hf"):
        lines += ["| engine (1k prompt) | decode tok/s | prefill ms | notes |", "| --- | --- | --- | --- |"]
        for h in r["hf"]:
            if "error" in h:
                lines.append(f"| {h['engine']} | failed | | {h['error'][:120]} |")
                continue
            note = f"warm-up {h['warmup_s']:.1f} s; first {h['same_first_tokens']} ids equal" if "warmup_s" in h else ""
            lines.append(f"| {h['engine']} | {h['decode_tok_s']:.1f} | {h['prefill_s'] * 1e3:.1f} | {note} |")
        if r.get("hf_ratio"):
            lines.append(f"\nredlite decode / best transformers decode: {r['hf_ratio']:.2f}x")
        lines += [""]
    if r.get("errors"):
        lines += ["Errors:", ""] + [f"- {e}" for e in r["errors"]] + [""]
    lines += ["Notes:", ""] + [f"- {n}" for n in m.get("notes", [])]
    return "\n".join(lines) + "\n"
