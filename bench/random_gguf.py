"""Write a llama-shaped GGUF file with random Q4_K weights (for speed benchmarks only).

``gguf.quants`` (0.19) quantizes Q4_0/Q4_1/Q5_x/Q8_0 but not the K-quants, so the Q4_K
blocks are written directly: random 4-bit codes and 6-bit sub-block scales/mins, with the
fp16 super-block scales ``d``/``dmin`` set so the weights come out near ``N(0, 0.02)``
(``dmin = 7.5 d`` centres ``d*sc*q - dmin*m``). Norm weights are float32 ones. The tokenizer
metadata (vocabulary, merges, chat template) is copied from a donor GGUF (the bundled
SmolLM2), so both redlite and llama.cpp load the file as a complete model.

    PYTHONPATH=src python bench/random_gguf.py OUT.gguf [--layers 28 --hidden 1536 ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

Q4_K_BLOCK = 144  # bytes per 256 values


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, cols // 256 * 144]``: valid Q4_K blocks with random codes and scales."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, Q4_K_BLOCK), dtype=np.uint8)
    d = np.full(blocks.shape[:2], 1.4e-4, dtype=np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:4] = (d * np.float16(7.5))[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def write(out: Path, donor: Path, *, layers: int, hidden: int, inter: int, heads: int, kv_heads: int,
          seed: int = 0) -> None:
    """Write the model to ``out`` (tokenizer and vocabulary size from ``donor``)."""
    import gguf

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(donor))
    vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    head_dim = hidden // heads
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"random-llama-{layers}x{hidden}-Q4_K")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)

    def quant(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, random_q4_k(rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType.Q4_K)

    quant("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        quant(p + "attn_q.weight", heads * head_dim, hidden)
        quant(p + "attn_k.weight", kv_heads * head_dim, hidden)
        quant(p + "attn_v.weight", kv_heads * head_dim, hidden)
        quant(p + "attn_output.weight", hidden, heads * head_dim)
        quant(p + "ffn_gate.weight", inter, hidden)
        quant(p + "ffn_up.weight", inter, hidden)
        quant(p + "ffn_down.weight", hidden, inter)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--donor", type=Path, help="GGUF whose tokenizer is copied (default: the bundled model)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--inter", type=int, default=8960)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    if args.donor is None:
        from redlite.loading.bundled import bundled_model_path

        args.donor = bundled_model_path()
    write(args.out, args.donor, layers=args.layers, hidden=args.hidden, inter=args.inter, heads=args.heads,
          kv_heads=args.kv_heads)


if __name__ == "__main__":
    main()
