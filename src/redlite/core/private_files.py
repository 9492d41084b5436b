"""Files only their owner may read: saved conversations decode to whole conversations.

:func:`open_private` creates (or truncates) a file with mode 0600 whatever the umask;
:func:`make_private_dir` creates a directory with mode 0700 (an existing directory is left as
it is, with a warning when other users may read it).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("redlite")


def open_private(path: str | os.PathLike, mode: str = "wb"):
    """``open(path, mode)`` for writing, the file created 0600 (an existing file is made 0600).
    Raises OSError."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def make_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and its parents) with mode 0700 for the last part; returns it.
    Raises OSError when it cannot be created."""
    path = Path(path)
    if path.is_dir():
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s may be read by other users; saved conversations in it are "
                        "private (chmod 700 it)", path)
        return path
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
