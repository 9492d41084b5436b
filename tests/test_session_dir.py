"""Session directory housekeeping: permissions, unusable directories, servers sharing one."""

import json
import os
import stat
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from redlite.core.parking import ParkedEntry
from redlite.core.session_dir import SessionDirError, prepare_session_dir
from redlite.core.session_file import (Expected, _canonical, read_state_file, write_state_file)
from redlite.core.sessions import SessionStore, entry_to_file
from redlite.engine.base import StateSnapshot

ECHO = Expected("echo-v1-rewind1", "none", "numpy")


def entry(ids, last_used=2.0):
    snap = StateSnapshot(len(ids), {"held": np.asarray(ids, dtype=np.int64)}, {}, "numpy")
    return ParkedEntry("k", list(ids), snap, [], 1.0, last_used)


def store(directory, **kw):
    kw.setdefault("min_tokens", 1)
    s = SessionStore(directory, ECHO, **kw)
    s.scan()
    return s


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_0600_and_directories_0700(tmp_path):
    directory = tmp_path / "a" / "sessions"
    s = store(directory)
    saved = s.save(entry([1, 2, 3]))
    assert mode(directory) == 0o700 and mode(saved.path) == 0o600
    saved.path.write_bytes(b"\x10")  # refused at load: moved to rejected/, also 0700
    assert s.load(saved.key) is None
    assert mode(directory / "rejected") == 0o700
    write_state_file(tmp_path / "slot.bin", *entry_to_file(entry([4]), ECHO))
    assert mode(tmp_path / "slot.bin") == 0o600


def test_an_unusable_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SessionDirError, match="cannot create session directory") as info:
        prepare_session_dir(tmp_path / "file" / "sessions")
    assert "\n" not in str(info.value)
    with pytest.raises(SessionDirError, match="cannot write to session directory"):
        prepare_session_dir("/proc/self/fdinfo")  # exists, takes no new files (even for root)


def test_server_refuses_an_unusable_directory_before_loading(tmp_path):
    (tmp_path / "file").write_text("x")
    done = subprocess.run([sys.executable, "-m", "redlite.cli", "serve", "--engine", "echo",
                           "--port", "0", "--session-dir", str(tmp_path / "file" / "s")],
                          capture_output=True, text=True, timeout=60)
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 1, output
    assert "Traceback" not in output and "loaded in" not in output  # before the engine loads
    assert len(output.splitlines()) == 1 and "cannot create session directory" in output


def test_two_servers_never_delete_each_others_files(tmp_path):
    a = store(tmp_path, keep=2)
    a_files = {a.save(entry([1] * n, 10.0 + n)).key for n in (3, 4)}
    b = store(tmp_path, keep=2)  # sees A's files (it can use them) ...
    used = sorted(a_files)[0]
    assert {e.key for e in b.entries()} == a_files and b.load(used) is not None  # used now
    b_files = [b.save(entry([2] * n, 20.0 + n)).key for n in (3, 4, 5)]
    names = {p.name for p in tmp_path.glob("rl-*.rlsession")}
    assert a_files <= names  # ... but never deletes them while A runs
    assert len(set(b_files) & names) == 2  # B's bounds hold its own files (A's count against A's)
    # an in-flight temporary file of a running writer survives another's start
    temp = tmp_path / f".rl-{b.owners.id}-00000000000000ee.rlsession.{os.getpid()}-0a0b0c0d.tmp"
    temp.write_bytes(b"partial")
    store(tmp_path, keep=100).close()
    assert temp.exists()
    # once A is gone its files are adopted: B's next prune may delete them
    a.close()
    b.prune()
    remaining = {p.name for p in tmp_path.glob("rl-*.rlsession")}
    assert remaining == {used, b_files[-1]}  # the two used last
    b.close()
    store(tmp_path).close()  # B gone too: its stale temporary file is removed
    assert not temp.exists()


def test_a_killed_servers_lock_does_not_keep_its_files(tmp_path):
    code = ("import sys, numpy as np; sys.path.insert(0, 'src');"
            "from redlite.core.sessions import SessionStore;"
            "from redlite.core.session_file import Expected;"
            "from redlite.core.parking import ParkedEntry;"
            "from redlite.engine.base import StateSnapshot;"
            f"s = SessionStore({str(tmp_path)!r}, Expected('echo-v1-rewind1', 'none', 'numpy'), min_tokens=1);"
            "s.scan(); snap = StateSnapshot(3, {'held': np.arange(3)}, {}, 'numpy');"
            "print(s.save(ParkedEntry('k', [0, 1, 2], snap, [], 1.0, 1.0)).key)")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           cwd=os.path.dirname(os.path.dirname(__file__)))
    assert child.returncode == 0, child.stderr
    orphan = child.stdout.strip()  # its writer exited without close(): the lock file is stale
    s = store(tmp_path, keep=0)
    assert not (tmp_path / orphan).exists()  # adopted and pruned
    assert list(tmp_path.glob(".rl-owner-*")) == []  # its stale lock removed; s wrote nothing
    s.save(entry([7, 8]))
    assert [p.name for p in tmp_path.glob(".rl-owner-*")] == [f".rl-owner-{s.owners.id}.lock"]
    s.close()
    assert list(tmp_path.glob(".rl-owner-*")) == []


def test_a_file_of_an_older_build_with_crc32_still_loads(tmp_path):
    path = tmp_path / "rl-00000000000000aa.rlsession"
    write_state_file(path, *entry_to_file(entry([5, 6, 7]), ECHO))
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"].pop("redlite"))
    table = {k: v for k, v in header.items() if k != "__metadata__"}
    meta["checksum"] = f"crc32:{zlib.crc32(data[8 + n:], zlib.crc32(_canonical(meta, table))):08x}"
    header["__metadata__"]["redlite"] = json.dumps(meta)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + n:])
    assert read_state_file(path, ECHO).tensors["state.held"].tolist() == [5, 6, 7]
    broken = bytearray(path.read_bytes())
    broken[-1] ^= 1
    path.write_bytes(broken)
    with pytest.raises(Exception, match="checksum"):
        read_state_file(path, ECHO)
