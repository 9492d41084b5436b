"""Housekeeping of a session directory shared by several servers (``--session-dir``).

Rules (issue 12 §5):

- the directory is created mode 0700 (its files decode to whole conversations); one that
  cannot be created or written is a :class:`SessionDirError` with a one-line message, raised
  before the model loads (:func:`prepare_session_dir`);
- each server process is an *owner* with a random 8-hex id, alive while it holds an exclusive
  ``flock`` on ``.rl-owner-<id>.lock`` in the directory (the kernel releases it when the
  process dies, however it dies). Session files carry their writer's id in their name
  (``rl-<owner>-<16 hex>.rlsession``), temporary files too (``.rl-<owner>-<16 hex>
  .rlsession.<pid>-<8 hex>.tmp``); a server deletes or moves aside only files it may
  (:meth:`Owners.may_delete`): its own, those of owners no longer alive, and files of older
  builds without an owner id. Files are written once, never rewritten in place;
- files refused at load are moved to ``rejected/`` inside the directory (a log line says so)
  and count against the directory's bounds until pruned; a server of the model and dtype a
  file there matches takes it back at its start (not one whose checksum failed: ``.damaged``).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from pathlib import Path

from redlite.core.private_files import make_private_dir

SESSION_NAME = re.compile(r"^rl-(?:(?P<owner>[0-9a-f]{8})-)?[0-9a-f]{16}\.rlsession$")
TEMP_NAME = re.compile(r"^\.rl-(?:(?P<owner>[0-9a-f]{8})-)?[0-9a-f]{16}\.rlsession"
                       r"\.[0-9]+(?:-[0-9a-f]{8})?\.tmp$")
LOCK_NAME = re.compile(r"^\.rl-owner-(?P<owner>[0-9a-f]{8})\.lock$")
REJECTED = "rejected"


class SessionDirError(Exception):
    """A session directory that cannot be used; ``str()`` is a one-line message."""


def prepare_session_dir(directory: str | os.PathLike) -> Path:
    """Create ``directory`` (mode 0700, parents as needed) and check that files can be created
    in it. Returns it as a Path. Raises SessionDirError."""
    path = Path(directory)
    try:
        make_private_dir(path)
    except OSError as error:
        raise SessionDirError(f"cannot create session directory {path}: "
                              f"{error.strerror or error}") from None
    if not path.is_dir():
        raise SessionDirError(f"session directory {path} is not a directory")
    probe = path / f".rl-probe-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise SessionDirError(f"cannot write to session directory {path}: "
                              f"{error.strerror or error}") from None
    return path


def owner_of(name: str) -> str | None:
    """The owner id in a session, temporary or lock file name (None: no id, or not ours)."""
    for pattern in (SESSION_NAME, TEMP_NAME, LOCK_NAME):
        match = pattern.match(name)
        if match:
            return match.group("owner")
    return None


class Owners:
    """This process's owner id in ``directory`` and the liveness of other owners. The lock
    is taken by :meth:`acquire`, before this server writes its first file (a server that
    never writes leaves no lock file behind), and given up by :meth:`close`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.id = secrets.token_hex(4)
        self._fd: int | None = None
        self._lock_path = directory / f".rl-owner-{self.id}.lock"

    def acquire(self) -> None:
        """Hold this owner's lock (no-op when held). Raises OSError."""
        if self._fd is not None:
            return
        staging = self.directory / f".rl-owner-{self.id}.lock.{os.getpid()}.new"
        # locked before it gets its final name, so no other server ever sees it unlocked
        fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(staging, self._lock_path)
        except OSError:
            os.close(fd)
            try:
                os.unlink(staging)
            except OSError:
                pass
            raise
        self._fd = fd

    def alive(self, owner: str) -> bool:
        """Whether ``owner`` holds its lock now (this process's own id: True)."""
        if owner == self.id:
            return True
        path = self.directory / f".rl-owner-{owner}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (EWOULDBLOCK), or not checkable: treated as alive
            return True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    def may_delete(self, name: str) -> bool:
        """Whether this server may delete or move the file ``name``: its own, one without an
        owner id (older builds), or one whose owner is gone."""
        owner = owner_of(name)
        return owner is None or owner == self.id or not self.alive(owner)

    def remove_stale_locks(self) -> int:
        """Delete the lock files of owners no longer alive; returns how many."""
        removed = 0
        for path in self.directory.iterdir():
            match = LOCK_NAME.match(path.name)
            if match and not self.alive(match.group("owner")):
                try:
                    path.unlink()
                    removed += 1
                except OSError:
                    pass
        return removed

    def close(self) -> None:
        """Give up the lock (this server's files become adoptable) and remove its file."""
        if self._fd is None:
            return
        try:
            os.unlink(self._lock_path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
