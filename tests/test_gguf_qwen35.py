"""GGUF ``qwen35`` / ``qwen35moe`` loading: a tiny random transformers Qwen3.5 model (dense
and mixture-of-experts, fewer key than value heads so the value-head reorder matters) is
written as a GGUF file by the ``gguf`` package the way llama.cpp's converter writes it (names
from the package's ``TensorNameMap``, norms stored as ``1 + w``, ``-exp(A_log)``, squeezed
conv, tiled value heads, stacked experts); redlite converts it and must give the logits of
the same model loaded from safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

from redlite.loading import gguf_qwen35
from redlite.loading.gguf import resolve_model_dir
from redlite.loading.hf import load_hf_model

L, F = "linear_attention", "full_attention"
COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, layer_types=[L, L, L, F],
              full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
ARCH = {"qwen35": MODEL_ARCH.QWEN35, "qwen35moe": MODEL_ARCH.QWEN35MOE}


def _tile(a: np.ndarray, axis: int, key_heads: int, per_key: int, dim: int) -> np.ndarray:
    """llama.cpp's value-head reorder: grouped by key head -> tiled, along ``axis``."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(key_heads, per_key, dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def _llama_cpp_tensors(model, cfg) -> dict[str, np.ndarray]:
    """HF name (as llama.cpp's converter renames it) -> array, with its value changes."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    per, qk = hv // hk, 2 * hk * dk
    out = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith("norm.weight") and "linear_attn.norm" not in name:
            a = a + 1.0
        elif name.endswith("A_log"):
            a = _tile(-np.exp(a), 0, hk, per, 1)
        elif name.endswith("dt_bias"):
            name, a = name.replace("dt_bias", "dt_proj.bias"), _tile(a, 0, hk, per, 1)
        elif name.endswith("conv1d.weight"):
            a = a.squeeze(1)
            a = np.concatenate([a[:qk], _tile(a[qk:], 0, hk, per, dv)])
        elif name.endswith("in_proj_qkv.weight"):
            a = np.concatenate([a[:qk], _tile(a[qk:], 0, hk, per, dv)])
        elif name.endswith("in_proj_z.weight"):
            a = _tile(a, 0, hk, per, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
            a = _tile(a, 0, hk, per, 1)
        elif name.endswith("out_proj.weight") and "linear_attn" in name:
            a = _tile(a, 1, hk, per, dv)
        elif name.endswith("shared_expert_gate.weight"):
            a = a.reshape(-1)  # llama.cpp loads it as one row [n_embd]
        if name.endswith("experts.gate_up_proj"):  # stacked per-expert halves
            base = name.removesuffix("gate_up_proj")
            out[base + "gate_proj.weight"] = a[:, :cfg.moe_intermediate_size]
            out[base + "up_proj.weight"] = a[:, cfg.moe_intermediate_size:]
            continue
        if name.endswith("experts.down_proj"):
            name += ".weight"
        out[name] = a
    return out


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the base of a byte-level BPE vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]


def _add_tokenizer(writer, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of ``vocab_size`` ids with llama.cpp's ``qwen35`` split."""
    tokens = _byte_alphabet() + ["he", "ll", "llo", "hello"]
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_merges(["h e", "l l", "ll o", "he llo"])
    writer.add_token_types([1] * 260 + [3] * (vocab_size - 260))
    writer.add_eos_token_id(vocab_size - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _write_gguf(model, arch: str, path: Path, tokenizer: bool = False) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer:
        _add_tokenizer(writer, cfg.vocab_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if arch == "qwen35":
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    rotary = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_dimension_sections([rotary // 4, rotary // 4, rotary // 2 - 2 * (rotary // 4), 0])  # M-RoPE
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_full_attention_interval(cfg.full_attention_interval)
    if arch == "qwen35moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    names = gguf.TensorNameMap(ARCH[arch], cfg.num_hidden_layers)
    for hf_name, array in _llama_cpp_tensors(model, cfg).items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference(arch: str):
    torch.manual_seed(0)
    if arch == "qwen35":
        cfg = transformers.Qwen3_5TextConfig(**COMMON, intermediate_size=48)
        model = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**COMMON, **MOE)
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.005, 1.0, generator=gen).log())
            else:  # every weight non-trivial, norms and biases included
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_block_tensor_names_are_the_gguf_packages():
    """Our table covers exactly the block tensors the gguf package lists for the two
    architectures, and the global ones are in both lists."""
    listed = {arch: {TENSOR_NAMES[t] for t in MODEL_TENSORS[model_arch]} for arch, model_arch in ARCH.items()}
    blocks = {n.removeprefix("blk.{bid}.") for names in listed.values() for n in names if n.startswith("blk.")}
    assert set(gguf_qwen35.BLOCK_TENSORS) == blocks
    for names in listed.values():
        assert {n.removesuffix(".weight") for n in gguf_qwen35.GLOBAL_TENSORS} <= names


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35"])
def test_gguf_logits_equal_safetensors_load(arch: str, tmp_path: Path):
    reference = _reference(arch)
    reference.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(reference, arch, path, tokenizer=arch == "qwen35moe")

    directory = resolve_model_dir(path, cache_dir=tmp_path / "cache")
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == gguf_qwen35.ARCHITECTURES[arch][0]
    if arch == "qwen35moe":  # the tokenizer came along: byte-level BPE, merges applied
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        ids = tokenizer.encode("hello héllo", add_special_tokens=False)
        assert tokenizer.decode(ids) == "hello héllo" and ids[0] == 259  # "hello" is one token
    from_gguf, _ = load_hf_model(directory, "cpu", torch.float32)
    from_hf, _ = load_hf_model(tmp_path / "hf", "cpu", torch.float32)
    ids = torch.tensor([3, 17, 42, 5, 88, 1, 60, 9, 33, 71, 2, 64])
    with torch.inference_mode():
        want = from_hf(ids, from_hf.new_state(32, "cpu", torch.float32), all_logits=True)
        got = from_gguf(ids, from_gguf.new_state(32, "cpu", torch.float32), all_logits=True)
        hf_logits = reference(ids[None]).logits[0]
    assert want.std().item() > 0.1
    assert (got - want).abs().max().item() < 1e-4
    assert (want - hf_logits).abs().max().item() < 1e-4


def test_unknown_tensor_is_reported():
    with pytest.raises(ValueError, match="blk.0.ffn_norm_exps"):
        gguf_qwen35.hf_name("blk.0.ffn_norm_exps.weight")
