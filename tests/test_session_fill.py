"""A saved state read straight into the torch engine's cache (no copy), verified on the way."""

import logging

import pytest
import torch

from redlite.core.live_state import capture, install
from redlite.core.generation import Generator
from redlite.core.generation_request import GeneratorSettings
from redlite.core.session_file import Expected, SessionFileError, open_state_file, write_state_file
from redlite.core.sessions import SessionStore, entry_to_file, expected_for
from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.engine.torch_engine import TorchEngine
from test_fingerprint import model


@pytest.fixture(scope="module")
def weights():
    return model(seed=5)


def generator(weights, ctx=64):
    return Generator(TorchEngine(weights, ctx_size=ctx), ByteTokenizer(), GeneratorSettings())


def saved_conversation(weights, tmp_path, n=23):
    source = generator(weights)
    source.engine.prefill(list(range(1, n + 1)))
    source.held_ids = list(range(1, n + 1))
    store = SessionStore(tmp_path, expected_for(source.engine), min_tokens=1)
    store.scan()
    saved = store.save(capture(source, "k", 5.0))
    return source, store, saved


def test_restore_fills_the_cache_in_place_and_matches(weights, tmp_path):
    source, store, saved = saved_conversation(weights, tmp_path)
    target = generator(weights)
    target.engine.prefill([7] * 30)  # something else held before
    cache = target.engine.state.cache.data
    entry = store.load(saved.key)
    assert install(target, entry)
    assert target.held_ids == source.held_ids and target.engine.n_past == 23
    assert entry.snapshot.tensors["kv"].data_ptr() == cache.data_ptr()  # read into the cache itself
    assert torch.equal(cache[:, :, :, :23], source.engine.state.cache.data[:, :, :, :23])
    assert torch.equal(target.engine.decode(5), source.engine.decode(5))


def test_the_file_is_unmapped_once_the_restored_entry_is_dropped(weights, tmp_path):
    """No entry -> fill -> entry cycle: the mapping goes with the entry (reference counting),
    not at a later garbage collection that would free the file's pages in whatever runs then."""
    import gc

    _, store, saved = saved_conversation(weights, tmp_path)
    target = generator(weights)

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return any(str(saved.path) in line for line in f)

    gc.disable()
    try:
        entry = store.load(saved.key)
        assert mapped()
        assert install(target, entry) and entry.fill is None
        del entry
        assert not mapped()
    finally:
        gc.enable()
    assert target.engine.n_past == 23


def test_a_flipped_byte_is_refused_during_the_fill_and_the_engine_reset(weights, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _, store, saved = saved_conversation(weights, tmp_path)
    data = bytearray(saved.path.read_bytes())
    data[len(data) - 1000] ^= 0x04  # inside the KV data
    saved.path.write_bytes(data)
    target = generator(weights)
    target.engine.prefill([7] * 30)
    target.held_ids = [7] * 30
    assert not install(target, store.load(saved.key))
    assert target.held_ids == [] and target.engine.n_past == 0
    assert "reason=checksum" in caplog.text and "moved to rejected/" in caplog.text
    assert (tmp_path / "rejected" / (saved.key + ".damaged")).exists() and saved.key not in store


def test_fill_checks_targets_and_reads_strided_views(tmp_path):
    kv = torch.randn(2, 2, 3, 5, 4).to(torch.bfloat16)
    expected = Expected("fp", "bfloat16", "torch")
    from redlite.core.parking import ParkedEntry
    from redlite.engine.base import StateSnapshot
    meta, tensors = entry_to_file(ParkedEntry("k", [1] * 5, StateSnapshot(5, {"kv": kv}, {}, "torch")),
                                  expected)
    write_state_file(tmp_path / "f", meta, tensors)
    big = torch.zeros(2, 2, 3, 9, 4, dtype=torch.bfloat16)
    out = open_state_file(tmp_path / "f", expected).fill({"state.kv": big[:, :, :, :5]})
    assert torch.equal(big[:, :, :, :5], kv) and not big[:, :, :, 5:].any()
    assert out["state.kv"].data_ptr() == big.data_ptr()
    with pytest.raises(SessionFileError, match="does not fit"):
        open_state_file(tmp_path / "f", expected).fill({"state.kv": torch.zeros(2, 2, 3, 5, 4)})
    # a truncated file is refused before any fill
    data = (tmp_path / "f").read_bytes()
    (tmp_path / "f").write_bytes(data[:-7])
    with pytest.raises(SessionFileError) as info:
        open_state_file(tmp_path / "f", expected)
    assert info.value.reason == "truncated"


def test_fill_in_small_batches_with_an_offset_view_and_a_corrupt_byte(tmp_path, monkeypatch):
    """Many scatter reads (a batch limit smaller than a block, so blocks are cut and batches
    span several blocks) into a view that starts inside its storage; then one flipped data byte
    is refused by the checksum the hashing thread computed."""
    from redlite.core import session_read
    from redlite.core.parking import ParkedEntry
    from redlite.engine.base import StateSnapshot

    monkeypatch.setattr(session_read, "READ_CHUNK", 56)  # bytes: blocks are 5*4*4 = 80 bytes
    kv = torch.randn(2, 2, 3, 5, 4)
    expected = Expected("fp", "float32", "torch")
    meta, tensors = entry_to_file(ParkedEntry("k", [1] * 5, StateSnapshot(5, {"kv": kv}, {}, "torch")),
                                  expected)
    path = tmp_path / "f"
    write_state_file(path, meta, tensors)
    big = torch.zeros(3, 2, 2, 3, 9, 4)
    target = big[1][:, :, :, 2:7]  # storage offset > 0, strided
    open_state_file(path, expected).fill({"state.kv": target})
    assert torch.equal(target, kv) and big[0].abs().sum() == 0 and big[2].abs().sum() == 0
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(SessionFileError) as info:
        open_state_file(path, expected).fill({"state.kv": target})
    assert info.value.reason == "checksum"


def test_read_batch_refuses_a_short_file(tmp_path):
    from redlite.core.session_read import _read_batch

    path = tmp_path / "short"
    path.write_bytes(bytes(range(10)))
    a, b = bytearray(4), bytearray(4)
    with open(path, "rb") as f:
        assert _read_batch(f.fileno(), [memoryview(a), memoryview(b)], 1) == 8
        assert bytes(a + b) == bytes(range(1, 9))
        with pytest.raises(SessionFileError) as info:
            _read_batch(f.fileno(), [memoryview(a), memoryview(b)], 5)
    assert info.value.reason == "truncated"
