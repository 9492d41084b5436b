"""Helpers of bench/hybrid.py: the Qwen3.5 shapes, the transformers model with random weights,
the byte and FLOP counts of a decode token, the run's metadata and the markdown report."""

from __future__ import annotations

import datetime
import platform
import re

import torch

import gpu_hf

COMMON = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
          "hidden_act": "silu", "rms_norm_eps": 1e-6, "full_attention_interval": 4,
          "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
          "linear_num_key_heads": 16, "head_dim": 256, "max_position_embeddings": 262144,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
# Shapes as published for the Qwen3.5 dense models (3 Gated DeltaNet layers per full-attention
# layer); "tiny" is a smoke test of the script.
SHAPES = {
    "0.8b": {**COMMON, "hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 3584,
             "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_value_heads": 16,
             "tie_word_embeddings": True},
    "9b": {**COMMON, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 12288,
           "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_value_heads": 32,
           "tie_word_embeddings": False},
    # the mixture-of-experts shape (transformers' Qwen3_5MoeTextConfig defaults, checkpoint
    # Qwen/Qwen3.5-35B-A3B): every layer's MLP is 256 experts, 8 per token, plus a shared expert
    "35b-a3b": {**COMMON, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                "num_key_value_heads": 2, "linear_num_value_heads": 32, "num_experts": 256,
                "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "tie_word_embeddings": False},
    "tiny": {**COMMON, "vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
             "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
             "tie_word_embeddings": False},
}
SHAPES["tiny-moe"] = {**SHAPES["tiny"], "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                      "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                      "shared_expert_intermediate_size": 64}

NOTES = [
    "Random weights (transformers' initialisation) in the Qwen3.5 shape named; redlite loads the "
    "transformers model's state_dict, so both engines run the same weights.",
    "Decode: KV rows of the full-attention layers filled with random values and n_past set directly; "
    "tok/s over the timed tokens with the greedy id read on the host every step; best of 2 runs.",
    "Decode bound = copy bandwidth / (weight bytes + KV bytes at the mean context + conv and recurrent "
    "state bytes read and written once per token).",
    "Decode split: one graph-captured step with a group of ops left out (their earlier outputs "
    "reused); differences give each group's share.",
    "Prefill FLOPs = 2 x layer matmul parameters per token + 2 x lm_head parameters + causal attention "
    "4 x heads x head_dim x P(P+1)/2 per full-attention layer + the chunked delta rule "
    "(6 Dk Dv + 4 C Dk + 2 C Dv per token and value head, C = 64).",
    "Mixture-of-experts shape (35b-a3b): redlite's model uses transformers' own expert tensors (one "
    "70 GB copy on the device); a decode token reads the router, the shared expert and the "
    "num_experts_per_tok chosen experts of every layer, and the bound counts exactly those bytes. The MoE "
    "step settings are swept on the model's first 8 layers before the decode graph is captured (table "
    "above); transformers' prefill is one forward over the same prompt (no cache, last logits only).",
    "Fork: turn 1 is a random prompt with a message boundary 64 tokens before its end + 8 generated "
    "tokens (checkpoints every 8192 tokens, at the boundary and at the end); turn 2 keeps the prompt up "
    "to the boundary and adds 64 new tokens. Reuse: best of 3; no reuse: once.",
]


def meta(device: torch.device, shape: str, out: str | None) -> dict:
    date = datetime.date.today().isoformat()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()}-cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for package in ("transformers", "triton", "fla"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - not installed
            versions[package] = None
    return {"date": date, "device": name, "shape": shape, "versions": versions, "out": out,
            "stem": f"hybrid-{date}-{slug}-{shape}", "notes": NOTES}


def build_hf(config: dict, device: torch.device, dtype: torch.dtype):
    """transformers ``Qwen3_5ForCausalLM`` (``Qwen3_5MoeForCausalLM`` when ``num_experts``) of
    ``config`` with its random initialisation, built on ``device`` in ``dtype``."""
    import transformers

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    moe = bool(config.get("num_experts"))
    hf_config = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**kwargs)
    hf_config._attn_implementation = "sdpa"
    hf_config.eos_token_id = None
    hf_config.pad_token_id = 0
    return gpu_hf.build_hf(hf_config, device, dtype,
                           transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM)


def model_sizes(model) -> dict:
    """Bytes read per decode token and matmul parameter counts of a Qwen3_5Model. MoE layers
    count the router, the shared expert and ``num_experts_per_tok`` routed experts (the
    experts not chosen are not read)."""
    esize = model.embed_weight.element_size()
    total = sum(p.numel() for p in model.parameters())
    embed = model.embed_weight.numel()
    hidden = model.embed_weight.shape[1]
    read = (total - (0 if model.tied else embed) + hidden) * esize
    matmul = kv = state = 0
    for layer in model.layers:
        mlp = layer.mlp
        if getattr(layer, "moe", False):
            per_expert = (mlp.gate_up_weight[0].numel() + mlp.down_weight[0].numel())
            read -= (mlp.num_experts - mlp.top_k) * per_expert * esize
            matmul += (mlp.top_k * per_expert + mlp.gates_weight.numel()
                       + mlp.shared.gate_up_weight.numel() + mlp.shared.down_weight.numel())
        else:
            matmul += mlp.gate_up_weight.numel() + mlp.down_weight.numel()
        if layer.layer_type == "linear_attention":
            m = layer.linear_attn
            matmul += m.in_proj_weight.numel() + m.out_weight.numel()
            recurrent = m.num_value_heads * m.key_head_dim * m.value_head_dim * 4
            state += 2 * (recurrent + m.conv_dim * (m.conv_kernel_size - 1) * esize)
        else:
            a = layer.self_attn
            matmul += a.qkv_weight.numel() + a.o_weight.numel()
            kv += 2 * a.n_kv_heads * a.head_dim * esize
    return {"weight_bytes_per_token": read, "layer_matmul_params": matmul, "lm_head_params": model.lm_head_weight.numel(),
            "kv_bytes_per_token": kv, "state_bytes_per_token": state, "params": total}


def _fmt(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(R: dict) -> str:
    m = R["meta"]
    lines = [f"# Qwen3.5 hybrid ({m.get('shape')} shape) on {m.get('device')} ({m.get('date')})", "",
             f"versions: {m.get('versions')}", ""]
    c = R.get("ceilings") or {}
    if c:
        lines += ["| ceiling | measured |", "|---|---:|",
                  f"| device-to-device copy (read + write) | {c['copy_bw_Bps'] / 1e12:.3f} TB/s |",
                  f"| bf16 matmul {c['matmul_n']}^3 | {c['matmul_flops'] / 1e12:.1f} TFLOP/s |", ""]
    if R.get("checks"):
        lines += ["checks: " + ", ".join(f"{k} = {v:.2e}" if isinstance(v, float) else f"{k} = {v}"
                                         for k, v in R["checks"].items()), ""]
    if R.get("decode"):
        lines += ["| decode context | tok/s | bound tok/s | GB read/token | % of bound |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['context']} | {r['tok_s']:.1f} | {r['bound_tok_s']:.1f} | {r['bytes_per_token'] / 1e9:.2f} "
                  f"| {r['pct_of_bound']:.1f}% |" for r in R["decode"]] + [""]
    if R.get("decode_split"):
        lines += ["| decode step variant | context | ms |", "|---|---:|---:|"]
        lines += [f"| {r['variant']} | {r['context']} | {r['ms']:.3f} |" for r in R["decode_split"]] + [""]
    if R.get("moe_tune"):
        lines += ["| MoE decode step (one layer) | µs | GB/s | % of copy bandwidth |", "|---|---:|---:|---:|"]
        lines += [f"| {r['variant']} | {r['us_per_layer']:.2f} | {r['GBps']:.0f} | {_fmt(r['pct_of_copy_bw'])}% |"
                  for r in R["moe_tune"] if "us_per_layer" in r] + [""]
        lines += ["MoE step kernels, µs per layer: " + ", ".join(f"{k} {v:.2f}" for k, v in r["kernels_us"].items())
                  for r in R["moe_tune"] if "kernels_us" in r] + [""]
    if R.get("checkpoint"):
        k = R["checkpoint"]
        lines += [f"checkpoint: {k['bytes'] / 2 ** 20:.1f} MiB on {k['device']}, take {k['take_ms']:.3f} ms, "
                  f"restore {k['restore_ms']:.3f} ms", ""]
    if R.get("prefill"):
        lines += ["| prefill engine | tokens | tok/s | ms | TFLOP/s | % of matmul peak | fla |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r.get('engine', 'redlite')} | {r['tokens']} | {r['tok_s']:.0f} | {r['seconds'] * 1e3:.1f} "
                  f"| {_fmt(r['tflops'])} | {_fmt(r['pct_of_matmul_peak'])}% | {r['fla']} |" for r in R["prefill"]]
        lines += [f"\nredlite prefill / transformers prefill at {n}: {x:.2f}x"
                  for n, x in (R.get("prefill_vs_transformers") or {}).items()] + [""]
    if R.get("fork"):
        lines += ["| fork: held, forked before end | reuse ms | no reuse ms | no reuse / reuse |", "|---|---:|---:|---:|"]
        lines += [f"| {r['context']}, {r['fork_before_end']} | {r['reuse_ms']:.1f} | {r['no_reuse_ms']:.1f} "
                  f"| {r['no_reuse_over_reuse']:.1f}x |" for r in R["fork"]] + [""]
    if R.get("hf"):
        lines += ["| engine (1k prompt) | decode tok/s | prefill ms |", "|---|---:|---:|"]
        for r in R["hf"]:
            if "error" in r:
                lines.append(f"| {r['engine']} | failed: {r['error'][:80]} | |")
            else:
                lines.append(f"| {r['engine']} | {r['decode_tok_s']:.1f} | {r['prefill_s'] * 1e3:.1f} |")
        if R.get("hf_ratio"):
            lines.append(f"\nredlite decode / best transformers decode: {R['hf_ratio']:.2f}x")
        lines.append("")
    if R.get("errors"):
        lines += ["errors:", *[f"- {e}" for e in R["errors"]], ""]
    lines += ["Notes:", *[f"- {n}" for n in m.get("notes", [])]]
    return "\n".join(lines) + "\n"


def random_weights(model):
    """Fill a Qwen3_5Model with random weights in place (normal, std 0.02; decays and norm
    weights in their usual ranges) and return it; values do not change the work."""
    gen = torch.Generator(device=model.embed_weight.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(0.0, 2.0, generator=gen)
            elif "norm" in name or name.endswith("dt_bias"):
                param.normal_(0.0, 0.1, generator=gen)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()
