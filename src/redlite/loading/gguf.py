"""GGUF model file -> Hugging Face-format model directory (converted once, then cached).

The torch engine loads models from a Hugging Face directory (``config.json``, safetensors
weights, tokenizer files). :func:`resolve_model_dir` turns whatever the user named into such a
directory: a Hugging Face directory is used as it is; a ``.gguf`` file is converted once into a
cache directory and the cached result is used from then on (a warm call costs one ``stat``).

What a converted directory holds:

* ``config.json``: a transformers config of ``model_type`` ``llama``, ``qwen2``, ``qwen3``, ``qwen3_5_text`` or ``qwen3_5_moe_text``
  built from the GGUF metadata (see
  :func:`~redlite.loading.gguf_config.gguf_to_hf_config` for each key's source);
* ``generation_config.json``: bos/eos/pad ids from ``tokenizer.ggml.*``;
* for the Llama family, ``gguf_tensors.json``: the file's tensor table (architecture, then per tensor its name, GGML
  type, shape and byte range), so a start maps the weights without parsing the GGUF metadata
  (the tokenizer's arrays make that parse slow);
* ``model.gguf``: a symbolic link to the GGUF file itself (refreshed on every resolve, so a
  file reinstalled elsewhere keeps working): the weights stay there, quantized, and are read
  through a memory mapping at load (:mod:`redlite.loading.gguf_tensors`); for the Qwen3.5
  hybrids, ``model.safetensors`` (or shards) instead: every tensor dequantized to float32
  (:func:`~redlite.loading.gguf_weights.write_weights`);
* ``tokenizer.json`` and ``tokenizer_config.json`` (chat template from
  ``tokenizer.chat_template``, special tokens), made by transformers' own GGUF tokenizer
  conversion.

The cache root is the caller's ``cache_dir`` (the CLI's ``--cache-dir``) or ``~/.cache/redlite``; each GGUF file gets the
sub-directory ``gguf/<file stem>-<key>`` where ``key`` hashes the file's name, size, first and
last MiB and :data:`CONVERTER_VERSION`. A conversion writes into a temporary sibling directory and renames
it into place, under a per-key file lock, so a killed conversion never leaves a half cache and
two processes never convert the same file at once.

This module holds the entry points, the cache and the conversion steps' order; the work is in
:mod:`redlite.loading.gguf_config` (metadata -> ``config.json``, ``generation_config.json``)
and :mod:`redlite.loading.gguf_weights` (tensor names, Q/K un-permutation), whose public
names are re-exported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from redlite.loading.gguf_config import (
    SUPPORTED_ARCHITECTURES,
    generation_config,
    gguf_to_hf_config,
    llama3_rope_factors,
    llama3_rope_scaling_from_factors,
    read_field,
    write_json,
)
from redlite.loading import gguf_qwen35
from redlite.loading.progress import Progress
from redlite.loading.gguf_weights import MAX_SHARD_BYTES, hf_tensor_name, unpermute_rotary_rows, write_weights

__all__ = [
    "CONVERTER_VERSION",
    "GGUF_LINK",
    "MAX_SHARD_BYTES",
    "TENSOR_TABLE",
    "SUPPORTED_ARCHITECTURES",
    "convert_gguf",
    "default_cache_dir",
    "gguf_to_hf_config",
    "hf_tensor_name",
    "llama3_rope_factors",
    "llama3_rope_scaling_from_factors",
    "resolve_model_dir",
    "unpermute_rotary_rows",
]

logger = logging.getLogger("redlite.loading")

#: Bump when the converted output changes, so old cache entries are not used any more.
CONVERTER_VERSION = 2
#: Name of the link to the GGUF file inside a converted directory.
GGUF_LINK = "model.gguf"
#: Name of the tensor table inside a converted directory.
TENSOR_TABLE = "gguf_tensors.json"

# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """The cache root when none is given: ``~/.cache/redlite``."""
    return Path.home() / ".cache" / "redlite"


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
        _link_gguf(target, source)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process converted it while we waited
            _link_gguf(target, source)
            return target
        # Holding the lock, any temp dir of this key is the leftover of a killed conversion.
        for stale in target.parent.glob(f".tmp-{target.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete (files deleted by hand): convert afresh
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
        started = time.perf_counter()
        try:
            with Progress(f"first start: converting {source.name}") as progress:
                convert_gguf(source, tmp, progress)
            _link_gguf(tmp, source)
            # mkdtemp (and safetensors) create owner-only modes; the cache is ordinary files.
            tmp.chmod(0o755)
            for item in tmp.iterdir():
                if not item.is_symlink():
                    item.chmod(0o644)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("cached the conversion of %s at %s (%.1f s)", source, target, time.perf_counter() - started)
    return target


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 progress: Progress | None = None) -> None:
    """Convert one GGUF file into a Hugging Face-format directory ``out_dir`` (must exist).

    Writes ``config.json``, ``generation_config.json`` and the tokenizer files (when the GGUF
    has ``tokenizer.ggml.model``); the weights stay in the GGUF (every tensor name is checked
    here, so an unknown one fails now, not at load), except for the Qwen3.5 hybrids, whose
    weights are written dequantized to float32 safetensors. Not atomic by itself:
    :func:`resolve_model_dir` calls it on a temporary directory. Logs each step's duration;
    ``progress`` (optional) is told the stages and counts one unit for the parse, one per
    tensor and one for the tokenizer.

    Raises:
        ValueError: unsupported architecture, unknown tensor name or rope scaling, or a file
            that is not GGUF.
    """
    import gguf  # heavy-ish import (numpy); only on the cold path

    progress = progress or Progress("converting", show=False)
    progress.stage("reading the GGUF file")
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
    progress.expect(len(reader.tensors) + 2)
    progress.advance()
    hybrid = read_field(reader, "general.architecture") in gguf_qwen35.ARCHITECTURES
    progress.stage("weights to float32" if hybrid else "weights: tensor table")

    config = gguf_to_hf_config(reader)
    st = gguf_path.stat()
    config["redlite_gguf_source"] = {
        "file": gguf_path.name,
        "size": st.st_size,
        "general.name": read_field(reader, "general.name"),
        "general.file_type": read_field(reader, "general.file_type"),
        "converter_version": CONVERTER_VERSION,
    }
    if hybrid:
        n_tensors, _ = write_weights(reader, config, out, progress.advance)  # hybrids: float32
        progress.advance(len(reader.tensors) - n_tensors)  # tensors with no Hugging Face name
    else:
        write_json(out / TENSOR_TABLE, tensor_table(reader))
        progress.advance(len(reader.tensors))
    weights_done = time.perf_counter()
    progress.stage("tokenizer (transformers)")

    has_tokenizer = _write_tokenizer(gguf_path, reader, out)
    tokenizer_done = time.perf_counter()
    progress.advance()

    write_json(out / "generation_config.json", generation_config(reader))
    # config.json last: its presence marks a complete directory (see _is_complete).
    write_json(out / "config.json", config)
    logger.info(
        "converted %s (%s, %d layers) -> %s: %d tensors checked, tokenizer %s; "
        "parse %.1f s, names %.1f s, tokenizer %.1f s, total %.1f s",
        gguf_path.name,
        config["model_type"],
        config["num_hidden_layers"],
        out,
        len(reader.tensors),
        "written" if has_tokenizer else "absent from the GGUF",
        parsed - started,
        weights_done - parsed,
        tokenizer_done - weights_done,
        tokenizer_done - started,
    )


def tensor_table(reader: Any) -> dict[str, Any]:
    """``{"architecture": str, "tensors": [{"name", "type", "shape", "offset", "nbytes"}]}`` of
    an open ``gguf.GGUFReader``: GGML type name, shape in GGUF order (fastest dimension first),
    absolute byte offset and size of the data. Raises ValueError for a tensor name without a
    Hugging Face counterpart (so it fails at conversion, not at load)."""
    tensors = []
    for tensor in reader.tensors:
        hf_tensor_name(tensor.name)
        tensors.append({"name": tensor.name, "type": tensor.tensor_type.name,
                        "shape": [int(d) for d in tensor.shape.tolist()], "offset": int(tensor.data_offset),
                        "nbytes": int(tensor.n_bytes)})
    return {"architecture": read_field(reader, "general.architecture"), "tensors": tensors}


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _write_tokenizer(gguf_path: Path, reader: Any, out: Path) -> bool:
    """Write tokenizer.json + tokenizer_config.json with transformers' GGUF tokenizer conversion.

    The chat template (``tokenizer.chat_template``) is stored in ``tokenizer_config.json``
    (not a separate ``chat_template.jinja``). Returns False when the GGUF has no tokenizer.
    """
    if read_field(reader, "tokenizer.ggml.model") is None:
        logger.warning("%s has no tokenizer (tokenizer.ggml.model); no tokenizer files written", gguf_path.name)
        return False
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    template = read_field(reader, "tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = template
    for flag in ("add_bos_token", "add_eos_token"):
        value = read_field(reader, f"tokenizer.ggml.{flag}")
        if value is not None:
            tok_config.setdefault(flag, bool(value))
    # Paths of the temporary conversion directory are meaningless once the cache is in place.
    for key in ("name_or_path", "_name_or_path", "is_local", "local_files_only"):
        tok_config.pop(key, None)
    # transformers 5 writes its new class name; PreTrainedTokenizerFast loads in 4.x and 5.x alike.
    if tok_config.get("tokenizer_class") == "TokenizersBackend":
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    context_length = read_field(reader, f"{read_field(reader, 'general.architecture')}.context_length")
    if context_length is not None:
        tok_config["model_max_length"] = int(context_length)
    write_json(config_path, tok_config)
    return True


# --------------------------------------------------------------------------------------------
# Cache
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
    return any((target / name).is_file() for name in (TENSOR_TABLE, "model.safetensors", "model.safetensors.index.json"))


def _link_gguf(target: Path, source: Path) -> None:
    """Point ``target/model.gguf`` at ``source`` (atomically replaced when it points elsewhere:
    the same file installed at another path hashes to the same cache entry)."""
    link = target / GGUF_LINK
    if link.is_symlink() and os.readlink(link) == str(source):
        return
    tmp = target / f".{GGUF_LINK}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(source)
    os.replace(tmp, link)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
