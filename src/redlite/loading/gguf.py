"""GGUF model file -> Hugging Face-format model directory (converted once, then cached).

The torch engine loads models from a Hugging Face directory (``config.json``, safetensors
weights, tokenizer files). :func:`resolve_model_dir` turns whatever the user named into such a
directory: a Hugging Face directory is used as it is; a ``.gguf`` file is converted once into a
cache directory and the cached result is used from then on (a warm call costs one ``stat``).

What a converted directory holds:

* ``config.json``: a transformers config of ``model_type`` ``llama``, ``qwen2`` or ``qwen3``
  built from the GGUF metadata (see :func:`gguf_to_hf_config` for each key's source);
* ``generation_config.json``: bos/eos/pad ids from ``tokenizer.ggml.*``;
* ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards plus
  ``model.safetensors.index.json`` past :data:`MAX_SHARD_BYTES`): every tensor dequantized to
  float32 by ``gguf.quants.dequantize`` and renamed to Hugging Face names
  (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``); for the ``llama``
  architecture the Q and K rows are put back from llama.cpp's rotary layout;
* ``tokenizer.json`` and ``tokenizer_config.json`` (chat template from
  ``tokenizer.chat_template``, special tokens), made by transformers' own GGUF tokenizer
  conversion.

The cache root is ``$REDLITE_CACHE_DIR`` or ``~/.cache/redlite``; each GGUF file gets the
sub-directory ``gguf/<file stem>-<key>`` where ``key`` hashes the file's name, size, first and
last MiB and :data:`CONVERTER_VERSION`. A conversion writes into a temporary sibling directory and renames
it into place, under a per-key file lock, so a killed conversion never leaves a half cache and
two processes never convert the same file at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger("redlite.loading")

#: Bump when the converted output changes, so old cache entries are not used any more.
CONVERTER_VERSION = 1
#: Environment variable naming the cache root.
CACHE_DIR_ENV = "REDLITE_CACHE_DIR"
#: Largest safetensors file written (bytes of float32 data); bigger models are sharded.
MAX_SHARD_BYTES = 4 * 1024**3

#: GGUF ``general.architecture`` -> (transformers ``model_type``, ``architectures`` entry).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# GGUF tensor names (llama.cpp's gguf-py ``TENSOR_NAMES``) -> Hugging Face names of the
# Llama/Qwen2/Qwen3 modelling code.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)")
# Tensors whose content goes into config.json instead of the weights.
_CONFIG_TENSORS = {"rope_freqs.weight"}

# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """The cache root: ``$REDLITE_CACHE_DIR`` when set and non-empty, else ``~/.cache/redlite``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "redlite"


def resolve_model_dir(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return a Hugging Face-format model directory for ``path``.

    path: a Hugging Face model directory (holding ``config.json``), returned as it is
        (resolved to an absolute path); or a ``.gguf`` file, converted on first use into
        ``<cache root>/gguf/<stem>-<key>`` (see the module docstring) and that directory
        returned; or a directory without ``config.json`` holding exactly one ``.gguf`` file,
        treated as that file.
    cache_dir: the cache root; None means :func:`default_cache_dir`.

    A warm call (cache present) only stats the file: no GGUF parsing, no heavy imports.
    The cold path logs (logger ``redlite.loading``) what it converted and how long it took.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a directory that is neither a
            Hugging Face model directory nor holds exactly one ``.gguf`` file.
        ValueError: the GGUF file is not a GGUF file, or its architecture, a tensor or its
            rope scaling is not supported (see :data:`SUPPORTED_ARCHITECTURES`).
    """
    source = Path(path).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"model path does not exist: {source}")
    if source.is_dir():
        if (source / "config.json").is_file():
            return source.resolve()
        ggufs = sorted(p for p in source.iterdir() if p.suffix == ".gguf" and p.is_file())
        if len(ggufs) != 1:
            raise FileNotFoundError(
                f"{source} is not a Hugging Face model directory (no config.json) and holds "
                f"{len(ggufs)} .gguf files instead of exactly one"
            )
        source = ggufs[0]
    source = source.resolve()

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "gguf" / _cache_name(source)
    if _is_complete(target):
        logger.debug("using cached conversion %s of %s", target, source)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process converted it while we waited
            return target
        # Holding the lock, any temp dir of this key is the leftover of a killed conversion.
        for stale in target.parent.glob(f".tmp-{target.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete (files deleted by hand): convert afresh
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
        started = time.perf_counter()
        try:
            convert_gguf(source, tmp)
            # mkdtemp (and safetensors) create owner-only modes; the cache is ordinary files.
            tmp.chmod(0o755)
            for item in tmp.iterdir():
                item.chmod(0o644)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("cached the conversion of %s at %s (%.1f s)", source, target, time.perf_counter() - started)
    return target


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Convert one GGUF file into a Hugging Face-format directory ``out_dir`` (must exist).

    Writes ``config.json``, ``generation_config.json``, the float32 safetensors weights and
    the tokenizer files (when the GGUF has ``tokenizer.ggml.model``). Not atomic by itself:
    :func:`resolve_model_dir` calls it on a temporary directory. Logs each step's duration.

    Raises:
        ValueError: unsupported architecture, unknown tensor name or rope scaling, or a file
            that is not GGUF.
    """
    import gguf  # heavy-ish import (numpy); only on the cold path

    gguf_path = Path(gguf_path)
    out = Path(out_dir)
    started = time.perf_counter()
    with open(gguf_path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except ValueError as err:
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {err}") from err
    parsed = time.perf_counter()

    config = gguf_to_hf_config(reader)
    st = gguf_path.stat()
    config["redlite_gguf_source"] = {
        "file": gguf_path.name,
        "size": st.st_size,
        "general.name": _field(reader, "general.name"),
        "general.file_type": _field(reader, "general.file_type"),
        "converter_version": CONVERTER_VERSION,
    }
    n_tensors, n_bytes = _write_weights(reader, config, out)
    weights_done = time.perf_counter()

    has_tokenizer = _write_tokenizer(gguf_path, reader, out)
    tokenizer_done = time.perf_counter()

    _write_json(out / "generation_config.json", _generation_config(reader))
    # config.json last: its presence marks a complete directory (see _is_complete).
    _write_json(out / "config.json", config)
    logger.info(
        "converted %s (%s, %d layers) -> %s: %d tensors, %.0f MB float32, tokenizer %s; "
        "parse %.1f s, weights %.1f s, tokenizer %.1f s, total %.1f s",
        gguf_path.name,
        config["model_type"],
        config["num_hidden_layers"],
        out,
        n_tensors,
        n_bytes / 1e6,
        "written" if has_tokenizer else "absent from the GGUF",
        parsed - started,
        weights_done - parsed,
        tokenizer_done - weights_done,
        tokenizer_done - started,
    )


def gguf_to_hf_config(reader: Any) -> dict[str, Any]:
    """Build a transformers ``config.json`` dict from an open ``gguf.GGUFReader``.

    Sources (``{arch}`` = ``general.architecture``):
    ``num_hidden_layers`` <- ``{arch}.block_count``; ``hidden_size`` <-
    ``{arch}.embedding_length``; ``intermediate_size`` <- ``{arch}.feed_forward_length``;
    ``num_attention_heads`` <- ``{arch}.attention.head_count``; ``num_key_value_heads`` <-
    ``{arch}.attention.head_count_kv`` (default: head_count); ``head_dim`` <-
    ``{arch}.attention.key_length``, else ``{arch}.rope.dimension_count`` (llama), else
    hidden_size / heads; ``rope_theta`` <- ``{arch}.rope.freq_base`` (default 10000.0);
    ``rms_norm_eps`` <- ``{arch}.attention.layer_norm_rms_epsilon`` (default 1e-5);
    ``max_position_embeddings`` <- ``{arch}.context_length``; ``rope_scaling`` <-
    ``{arch}.rope.scaling.{type,factor,original_context_length,attn_factor,yarn_beta_fast,
    yarn_beta_slow}`` or, for Llama 3 style scaling, the ``rope_freqs.weight`` tensor;
    ``vocab_size`` <- rows of ``token_embd.weight``; ``tie_word_embeddings`` <- no
    ``output.weight`` tensor; ``attention_bias`` <- an ``attn_q.bias`` tensor exists;
    ``bos_token_id``/``eos_token_id``/``pad_token_id`` <- ``tokenizer.ggml.*_token_id``.
    Rope settings are written both as legacy ``rope_theta``/``rope_scaling`` and as
    transformers 5's ``rope_parameters``.

    Raises:
        ValueError: unsupported architecture, a required key missing, or rope scaling that
            cannot be expressed as a transformers ``rope_scaling``.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    model_type, hf_class = SUPPORTED_ARCHITECTURES[arch]

    def required(key: str) -> Any:
        value = _field(reader, key.format(arch=arch))
        if value is None:
            raise ValueError(f"GGUF file lacks the required key {key.format(arch=arch)!r}")
        return value

    def optional(key: str, default: Any = None) -> Any:
        value = _field(reader, key.format(arch=arch))
        return default if value is None else value

    tensors = {t.name: t for t in reader.tensors}
    n_layers = int(required("{arch}.block_count"))
    hidden = int(required("{arch}.embedding_length"))
    n_heads = int(required("{arch}.attention.head_count"))
    n_kv_heads = int(optional("{arch}.attention.head_count_kv", n_heads))
    head_dim = optional("{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = optional("{arch}.rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads
    rope_theta = float(optional("{arch}.rope.freq_base", 10000.0))

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shape is [hidden, vocab]
    meta_vocab = optional("{arch}.vocab_size")
    if meta_vocab is not None and int(meta_vocab) != vocab_size:
        logger.warning("%s.vocab_size=%s differs from token_embd rows %d; using the latter", arch, meta_vocab, vocab_size)

    rope_scaling = _rope_scaling(reader, arch, rope_theta, head_dim, tensors)
    context_length = optional("{arch}.context_length")
    if context_length is None:
        context_length = 4096
        logger.warning("GGUF file lacks %s.context_length; assuming %d", arch, context_length)

    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(required("{arch}.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(context_length),
        "rms_norm_eps": float(optional("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}
        if rope_scaling is None
        else {**rope_scaling, "rope_theta": rope_theta},
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "attention_dropout": 0.0,
        "bos_token_id": _int_or_none(optional("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _int_or_none(optional("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _int_or_none(optional("tokenizer.ggml.padding_token_id")),
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    return config


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor (``blk.3.ffn_up.weight`` ->
    ``model.layers.3.mlp.up_proj.weight``); None for tensors folded into ``config.json``
    (``rope_freqs.weight``).

    Raises:
        ValueError: a tensor this converter does not know (e.g. a fused ``attn_qkv``).
    """
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _CONFIG_TENSORS:
        return None
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face counterpart")


def unpermute_rotary_rows(weight: Any, n_heads: int) -> Any:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (weight or bias).

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) stores, per head, the
    rows of the Hugging Face "rotate_half" layout (first half, second half) interleaved
    (pairs), i.e. ``w.reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2)``. This is the
    inverse. weight: float32 array of shape ``[n_heads * head_dim, ...]``; n_heads: the
    attention heads for Q, the KV heads for K. Returns a new C-contiguous array, same shape.
    """
    import numpy as np

    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    out = weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    return np.ascontiguousarray(out)


def _write_weights(reader: Any, config: dict[str, Any], out: Path) -> tuple[int, int]:
    """Dequantize, rename and save all tensors; returns (tensor count, bytes written)."""
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    arch = _field(reader, "general.architecture")
    planned: list[tuple[Any, str, int]] = []  # (reader tensor, hf name, float32 bytes)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        planned.append((tensor, name, int(tensor.n_elements) * 4))

    shards: list[list[tuple[Any, str, int]]] = [[]]
    size = 0
    for item in planned:
        if shards[-1] and size + item[2] > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[2]

    def load(tensor: Any) -> Any:
        data = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest-first
        data = np.asarray(data, dtype=np.float32).reshape(shape)
        if arch == "llama" and re.fullmatch(r"blk\.\d+\.attn_(q|k)\.(weight|bias)", tensor.name):
            heads = config["num_attention_heads"] if ".attn_q." in tensor.name else config["num_key_value_heads"]
            data = unpermute_rotary_rows(data, heads)
        return np.ascontiguousarray(data)

    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards):
        filename = (
            "model.safetensors" if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        arrays = {name: load(tensor) for tensor, name, _ in shard}
        save_file(arrays, str(out / filename), metadata={"format": "pt"})
        for name, array in arrays.items():
            weight_map[name] = filename
            total += array.nbytes
        del arrays
    if len(shards) > 1:
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )
    return len(weight_map), total


# --------------------------------------------------------------------------------------------
# Tokenizer and generation config
# --------------------------------------------------------------------------------------------


def _write_tokenizer(gguf_path: Path, reader: Any, out: Path) -> bool:
    """Write tokenizer.json + tokenizer_config.json with transformers' GGUF tokenizer conversion.

    The chat template (``tokenizer.chat_template``) is stored in ``tokenizer_config.json``
    (not a separate ``chat_template.jinja``). Returns False when the GGUF has no tokenizer.
    """
    if _field(reader, "tokenizer.ggml.model") is None:
        logger.warning("%s has no tokenizer (tokenizer.ggml.model); no tokenizer files written", gguf_path.name)
        return False
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = template
    for flag in ("add_bos_token", "add_eos_token"):
        value = _field(reader, f"tokenizer.ggml.{flag}")
        if value is not None:
            tok_config.setdefault(flag, bool(value))
    # Paths of the temporary conversion directory are meaningless once the cache is in place.
    for key in ("name_or_path", "_name_or_path", "is_local", "local_files_only"):
        tok_config.pop(key, None)
    # transformers 5 writes its new class name; PreTrainedTokenizerFast loads in 4.x and 5.x alike.
    if tok_config.get("tokenizer_class") == "TokenizersBackend":
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    context_length = _field(reader, f"{_field(reader, 'general.architecture')}.context_length")
    if context_length is not None:
        tok_config["model_max_length"] = int(context_length)
    _write_json(config_path, tok_config)
    return True


def _generation_config(reader: Any) -> dict[str, Any]:
    """bos/eos/pad ids for ``generation_config.json``: ``eos_token_id`` lists
    ``tokenizer.ggml.eos_token_id``, ``.eot_token_id`` and ``.eom_token_id`` (those present)."""
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _int_or_none(_field(reader, f"tokenizer.ggml.{key}"))
        if value is not None and value not in eos:
            eos.append(value)
    config: dict[str, Any] = {
        "bos_token_id": _int_or_none(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    pad = _int_or_none(_field(reader, "tokenizer.ggml.padding_token_id"))
    if pad is not None:
        config["pad_token_id"] = pad
    return config


# --------------------------------------------------------------------------------------------
# Rope scaling
# --------------------------------------------------------------------------------------------


def _rope_scaling(reader: Any, arch: str, rope_theta: float, head_dim: int, tensors: dict[str, Any]) -> dict | None:
    """transformers ``rope_scaling`` from ``{arch}.rope.scaling.*`` keys or ``rope_freqs.weight``."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and _field(reader, f"{arch}.rope.scale_linear") is not None:  # older files
        kind, factor = "linear", _field(reader, f"{arch}.rope.scale_linear")
    scaling: dict[str, Any] | None = None
    if kind in (None, "none"):
        scaling = None
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        extra = {
            "original_context_length": ("original_max_position_embeddings", int),
            "attn_factor": ("attention_factor", float),
            "yarn_beta_fast": ("beta_fast", float),
            "yarn_beta_slow": ("beta_slow", float),
        }
        for gguf_key, (hf_key, cast) in extra.items():
            value = _field(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = cast(value)
    else:
        raise ValueError(f"rope scaling type {kind!r} ({arch}.rope.scaling.type) is not supported")

    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ValueError("GGUF has both rope_freqs.weight and rope scaling keys; not supported")
        import numpy as np
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        scaling = llama3_rope_scaling_from_factors(freqs, rope_theta, head_dim)
    return scaling


def llama3_rope_factors(
    rope_theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> list[float]:
    """Per-frequency divisors of Llama 3 rope scaling, as llama.cpp's converter stores them in
    ``rope_freqs.weight`` (shape ``[head_dim // 2]``): 1 for wavelengths below
    ``original / high_freq_factor``, ``factor`` above ``original / low_freq_factor``, a smooth
    blend between. Same rule as transformers' ``_compute_llama3_parameters``."""
    low_wavelen = original / low_freq_factor
    high_wavelen = original / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (rope_theta ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def llama3_rope_scaling_from_factors(factors: Any, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """Recover transformers' ``{"rope_type": "llama3", ...}`` from a ``rope_freqs.weight`` tensor.

    The GGUF stores only the resulting divisors; ``factor`` is their maximum and the other
    parameters are searched among the values Llama 3.x releases use (low 1, high 4, original
    context 8192, plus a few neighbours), accepting a match within 1e-4 relative.

    Raises:
        ValueError: no parameter set reproduces the stored divisors.
    """
    import numpy as np

    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"rope_freqs.weight has {factors.shape[0]} values, expected {head_dim // 2}")
    factor = float(factors.max())
    if abs(factor - round(factor)) <= 1e-4 * factor:  # float32 storage blurs e.g. 8 into 8.000001
        factor = float(round(factor))
    for original in (8192, 4096, 16384, 2048, 32768, 131072):
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 8.0, 2.0):
                if high <= low:
                    continue
                expected = np.asarray(llama3_rope_factors(rope_theta, head_dim, factor, low, high, original))
                if np.allclose(expected, factors, rtol=1e-4, atol=0):
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": original,
                    }
    raise ValueError("rope_freqs.weight does not match Llama 3 rope scaling; not supported")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _cache_name(source: Path) -> str:
    """``<stem>-<16 hex>``: the hash covers the file's name, size, its first and last MiB
    (the GGUF header and metadata, and the end of the tensor data) and the converter version.
    Content, not mtime: a reinstall of the same file (a fresh venv) reuses the conversion."""
    size = source.stat().st_size
    digest = hashlib.sha256(f"{source.name}\0{size}\0{CONVERTER_VERSION}\0".encode("utf-8"))
    sample = 1 << 20
    with open(source, "rb") as f:
        digest.update(f.read(sample))
        if size > sample:
            f.seek(max(sample, size - sample))
            digest.update(f.read(sample))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source.stem)[:80]
    return f"{stem}-{digest.hexdigest()[:16]}"


def _is_complete(target: Path) -> bool:
    if not (target / "config.json").is_file():
        return False
    return (target / "model.safetensors").is_file() or (target / "model.safetensors.index.json").is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _field(reader: Any, key: str) -> Any:
    """A GGUF metadata value as a plain Python value (str, int, float, bool, list), or None."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if len(field.types) == 1 and field.types[0].name == "FLOAT32":
        # Shortest decimal that round-trips the stored float32 (1e-05, not 9.99999974e-06).
        import numpy as np

        return float(str(np.float32(value)))
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    return value


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
