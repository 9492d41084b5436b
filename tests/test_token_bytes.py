"""The bytes of each token id (:mod:`redlite.loading.token_bytes`) for the decoder kinds it
tells apart, on small ``tokenizers`` pipelines built here."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from redlite.loading.token_bytes import TokenBytes, _decoder_kinds, byte_level_table

VOCAB = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}


def byte_level() -> Tokenizer:
    to_char = {b: c for c, b in byte_level_table().items()}
    vocab = {to_char[b]: i for i, b in enumerate(range(256))}
    vocab["hi"] = 256
    vocab[to_char[ord(" ")] + "hi"] = 257
    tok = Tokenizer(models.BPE(vocab, [("h", "i"), (to_char[ord(" ")], "hi")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def metaspace() -> Tokenizer:
    vocab = {"<unk>": 0, "▁hi": 1, "<0x0A>": 2, "x": 3}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def plain() -> Tokenizer:
    return Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))


@pytest.mark.parametrize("build", [byte_level, metaspace, plain])
def test_decoder_kinds_read_from_the_decoder_alone_match_the_whole_json(build):
    tok = build()
    whole = json.loads(tok.to_str()).get("decoder") or {}
    steps = whole.get("decoders") or [whole]
    assert _decoder_kinds(tok) == {str(s.get("type")) for s in steps if isinstance(s, dict)}


def test_token_bytes_per_decoder_kind():
    level = TokenBytes(byte_level())
    assert level(257) == b" hi" and level(ord("\n")) == b"\n"
    meta = TokenBytes(metaspace())
    assert meta(1) == b" hi" and meta(2) == b"\n" and meta(3) == b"x"
    assert not _decoder_kinds(plain()) & {"ByteLevel", "Metaspace", "Replace", "ByteFallback"}
