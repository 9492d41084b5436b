"""The disk tier without a server: file format, faults, indexing, pruning."""

import errno
import json
import logging
import os
import re
import struct

import numpy as np
import pytest

from redlite.core.parking import ParkedCheckpoint, ParkedEntry
from redlite.core.session_file import (Expected, SessionFileError, read_meta, read_state_file,
                                       write_state_file)
from redlite.core.sessions import (SESSION_NAME, FileStats, SessionStore, entry_from_file,
                                   entry_to_file, plan_prune)
from redlite.engine.base import StateSnapshot

ECHO = Expected("echo-v1-rewind1", "none", "numpy")


def entry(ids, key="k", checkpoints=()):
    snap = StateSnapshot(len(ids), {"held": np.asarray(ids, dtype=np.int64)},
                         {"source": "6869", "generated": 1}, "numpy")
    cps = [ParkedCheckpoint(p, True, 8, {"logits": np.asarray([p], np.int64)}, {"generated": 0})
           for p in checkpoints]
    return ParkedEntry(key, list(ids), snap, cps, 1.0, 2.0)


def write(tmp_path, ids, name="rl-0000000000000001.rlsession", expected=ECHO, checkpoints=()):
    meta, tensors = entry_to_file(entry(ids, checkpoints=checkpoints), expected)
    path = tmp_path / name
    size = write_state_file(path, meta, tensors)
    assert size == path.stat().st_size
    return path


def test_round_trip_numpy_with_checkpoints(tmp_path):
    path = write(tmp_path, list(range(40)), checkpoints=[10, 40])
    state = read_state_file(path, ECHO)
    back = entry_from_file(state, "x")
    assert back.held_ids == list(range(40)) and back.tier == "disk"
    assert back.snapshot.tensors["held"].tolist() == list(range(40))
    assert back.snapshot.meta == {"source": "6869", "generated": 1}
    assert [(c.position, c.tensors["logits"].tolist(), c.meta) for c in back.checkpoints] == \
        [(10, [10], {"generated": 0}), (40, [40], {"generated": 0})]
    # a standard safetensors file, with the JSON metadata in its header
    from safetensors.numpy import load_file
    from safetensors import safe_open
    assert load_file(str(path))["state.held"].tolist() == list(range(40))
    with safe_open(str(path), "np") as f:
        meta = json.loads(f.metadata()["redlite"])
    for field in ("format", "version", "fingerprint", "dtype", "layout", "held_ids",
                  "checkpoints", "created", "last_used", "checksum"):
        assert field in meta
    assert re.fullmatch(r"xxh3:[0-9a-f]{16}", meta["checksum"])


def test_round_trip_torch_bfloat16(tmp_path):
    import torch
    kv = torch.randn(2, 2, 3, 5, 4).to(torch.bfloat16)
    snap = StateSnapshot(5, {"kv": kv, "rec": torch.zeros(0)}, {"layout": "LlamaState"}, "torch")
    expected = Expected("fp", "bfloat16", "torch")
    meta, tensors = entry_to_file(ParkedEntry("k", [1, 2, 3, 4, 5], snap), expected)
    write_state_file(tmp_path / "f", meta, tensors)
    state = read_state_file(tmp_path / "f", expected)
    back = entry_from_file(state, "k").snapshot
    assert torch.equal(back.tensors["kv"], kv) and back.tensors["kv"].dtype == torch.bfloat16
    assert back.tensors["rec"].shape == (0,)
    assert state.meta["layout"] == "LlamaState"


def test_every_flipped_byte_is_refused(tmp_path):
    path = write(tmp_path, list(range(12)), checkpoints=[12])
    data = path.read_bytes()
    bad = tmp_path / "bad"
    for i in range(len(data)):
        for mask in (0x01, 0x80):
            corrupted = bytearray(data)
            corrupted[i] ^= mask
            bad.write_bytes(corrupted)
            with pytest.raises(SessionFileError):
                read_state_file(bad, ECHO)


def test_every_truncation_is_refused(tmp_path):
    path = write(tmp_path, list(range(12)))
    data = path.read_bytes()
    bad = tmp_path / "bad"
    reasons = set()
    for n in range(len(data)):
        bad.write_bytes(data[:n])
        with pytest.raises(SessionFileError) as info:
            read_state_file(bad, ECHO)
        reasons.add(info.value.reason)
        if n >= 8:
            with pytest.raises(SessionFileError):
                read_meta(bad)
    assert "truncated" in reasons


@pytest.mark.parametrize("other,reason", [
    (Expected("another-model", "none", "numpy"), "fingerprint"),
    (Expected("echo-v1-rewind1", "bfloat16", "numpy"), "dtype"),
    (Expected("echo-v1-rewind1", "none", "torch"), "tensor-format"),
])
def test_other_model_or_dtype_is_refused(tmp_path, other, reason):
    path = write(tmp_path, [1, 2, 3])
    with pytest.raises(SessionFileError) as info:
        read_state_file(path, other)
    assert info.value.reason == reason


def test_other_format_version_is_refused(tmp_path):
    meta, tensors = entry_to_file(entry([1, 2]), ECHO)
    path = tmp_path / "v"
    write_state_file(path, meta, tensors)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    inner = json.loads(header["__metadata__"]["redlite"])
    inner["version"] = 99
    header["__metadata__"]["redlite"] = json.dumps(inner)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data[8 + n:]))
    with pytest.raises(SessionFileError) as info:
        read_state_file(path, ECHO)
    assert info.value.reason == "version"


def test_failed_write_leaves_no_file(tmp_path):
    class Full:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
    meta, tensors = entry_to_file(entry([1, 2, 3]), ECHO)
    with pytest.raises(OSError):
        write_state_file(tmp_path / "x", meta, tensors, opener=Full)
    assert list(tmp_path.iterdir()) == []


def store(tmp_path, **kw):
    kw.setdefault("min_tokens", 1)
    s = SessionStore(tmp_path, ECHO, **kw)
    s.scan()
    return s


def listing(directory):
    """Names in ``directory`` but the owner lock files."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".rl-owner-"))


def test_scan_indexes_ours_rejects_others_and_cleans_temp_files(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    write(tmp_path, [1, 2, 3], "rl-00000000000000aa.rlsession")
    write(tmp_path, [4, 5, 6], "rl-00000000000000bb.rlsession", Expected("other", "none", "numpy"))
    (tmp_path / "rl-00000000000000cc.rlsession").write_bytes(b"\x10\x00")
    (tmp_path / ".rl-00000000000000dd.rlsession.123.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("mine")
    s = store(tmp_path)
    assert [e.key for e in s.entries()] == ["rl-00000000000000aa.rlsession"]
    assert "refused file rl-00000000000000bb.rlsession reason=fingerprint" in caplog.text
    assert "refused file rl-00000000000000cc.rlsession reason=truncated" in caplog.text
    assert listing(tmp_path) == ["notes.txt", "rejected", "rl-00000000000000aa.rlsession"]
    assert listing(tmp_path / "rejected") == s.rejected() == [
        "rl-00000000000000bb.rlsession", "rl-00000000000000cc.rlsession"]
    # moved aside once: the next start neither refuses nor indexes them again
    caplog.clear()
    again = store(tmp_path)
    assert "refused" not in caplog.text and len(again) == 1 and len(again.rejected()) == 2
    assert "1 saved conversations indexed" in caplog.text and "2 rejected" in caplog.text


def test_load_refuses_a_corrupted_file_and_moves_it_aside(tmp_path, caplog):
    path = write(tmp_path, list(range(20)), "rl-00000000000000aa.rlsession")
    s = store(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(data)
    loaded = s.load("rl-00000000000000aa.rlsession")  # header fine: the checksum is verified
    with pytest.raises(SessionFileError) as info:    # while the engine copies the state in
        loaded.verify()
    assert info.value.reason == "checksum"
    assert "reason=checksum" in caplog.text and "moved to rejected/" in caplog.text
    assert len(s) == 0 and not path.exists()
    assert (tmp_path / "rejected" / (path.name + ".damaged")).read_bytes() == data  # kept for inspection
    assert s.load("rl-00000000000000aa.rlsession") is None
    again = store(tmp_path)  # its header is sound, but it is never taken back
    assert len(again) == 0 and again.rejected() == [path.name + ".damaged"]


def test_a_file_refused_by_another_model_is_taken_back_by_its_own(tmp_path, caplog):
    """A server of another model (or --kv-dtype) moves the file to rejected/; a server of the
    file's model and dtype indexes it again at its start; the bounds count it in between."""
    caplog.set_level(logging.INFO)
    theirs = Expected("other", "float32+kv-float16", "numpy")
    path = write(tmp_path, [4, 5, 6], "rl-00000000000000bb.rlsession", theirs)
    ours = store(tmp_path)
    assert len(ours) == 0 and ours.rejected() == [path.name] and not path.exists()
    ours.close()
    back = SessionStore(tmp_path, theirs, min_tokens=1)
    back.scan()
    assert [e.key for e in back.entries()] == [path.name] and back.rejected() == []
    assert path.exists() and "matches this model and dtype: moved back" in caplog.text
    assert store(tmp_path).rejected() == [path.name]  # and away again for the other model


def test_pruning_keeps_the_newest_and_deletes_only_our_files(tmp_path):
    foreign = ["notes.txt", "rl-XYZ.rlsession", "model.safetensors"]
    for name in foreign:
        (tmp_path / name).write_text("not ours")
    other_model = write(tmp_path, [9, 9], "rl-00000000000000ff.rlsession", Expected("other", "none", "numpy"))
    (tmp_path / "sub").mkdir()
    s = store(tmp_path, keep=3)
    assert s.rejected() == [other_model.name]  # counted against keep, and pruned first

    def used_at(ids, when):
        e = entry(ids)
        e.last_used = when
        return e
    saved = [s.save(used_at([i] * (5 + i), 100.0 + i)).key for i in range(6)]
    names = {p.name for p in tmp_path.iterdir()}
    assert set(saved[-3:]) <= names and not set(saved[:3]) & names
    assert set(foreign) <= names and "sub" in names
    assert len(s) == 3 and s.rejected() == [] and list((tmp_path / "rejected").iterdir()) == []
    # byte bound: each file is a few hundred bytes
    size = (tmp_path / saved[-1]).stat().st_size
    s.max_bytes = 2 * size + size // 2
    s.save(used_at([42] * 20, 200.0))
    assert len(s) == 2 and sum(e.nbytes for e in s.entries()) <= s.max_bytes
    # an entry older than every kept file is not written only to be pruned at once
    assert s.save(used_at([43] * 20, 50.0)) is None and len(s) == 2
    # after a restart the order of last use survives (file mtimes)
    again = store(tmp_path, keep=3)
    assert sorted(e.last_used for e in again.entries()) == sorted(e.last_used for e in s.entries())
    assert set(foreign) <= {p.name for p in tmp_path.iterdir()}


def test_plan_prune_is_lru_and_respects_protection():
    files = [FileStats("a", 10, 1.0), FileStats("b", 10, 2.0), FileStats("c", 10, 3.0)]
    assert plan_prune(files, 2, 100) == ["a"]
    assert plan_prune(files, 5, 15) == ["a", "b"]
    assert plan_prune(files, 1, 100, frozenset({"a"})) == ["b", "c"]
    assert plan_prune(files, 3, 30) == []


def test_save_dedupes_supersedes_and_respects_min_tokens(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    s = store(tmp_path, min_tokens=4)
    assert s.save(entry([1, 2, 3])) is None  # below min tokens
    first = s.save(entry([1, 2, 3, 4, 5]))
    again = s.save(entry([1, 2, 3, 4, 5]))
    assert again.key == first.key and len(s) == 1
    longer = s.save(entry([1, 2, 3, 4, 5, 6, 7]), supersede=True)
    assert [e.key for e in s.entries()] == [longer.key]
    assert not (tmp_path / first.key).exists()
    assert s.save(entry([1, 2, 3, 4, 5, 6]), supersede=True).key == longer.key  # covered
    assert s.save(entry([1, 2, 3, 4, 5, 6])).key != longer.key  # without rewind: its own file
    assert "reason=superseded" in caplog.text
    assert SESSION_NAME.match(longer.key)
    assert "saved 7 tok" in caplog.text


def test_failed_save_is_logged_not_raised(tmp_path, caplog):
    def full_disk(path, mode):
        raise OSError(errno.ENOSPC, "No space left on device")
    s = SessionStore(tmp_path, ECHO, min_tokens=1, opener=full_disk)
    s.scan()
    assert s.save(entry([1, 2, 3])) is None
    assert "save failed 3 tok reason=io" in caplog.text
    assert len(s) == 0 and listing(tmp_path) == []
