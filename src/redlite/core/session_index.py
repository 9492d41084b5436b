"""The index of a session directory: which files of this model it holds and what they hold.

:class:`SessionIndex` reads only file headers: at start (:meth:`SessionIndex.scan`) and when
another server sharing the directory wrote a file (:meth:`SessionIndex.refresh`). A file
refused (another model, dtype or format version, a bad header) is logged and moved to
``rejected/`` (:mod:`redlite.core.session_dir`) when this server may move it, so it is not
re-indexed at every start; a server whose model and dtype it matches takes it back from there
at its start (switching models or ``--kv-dtype`` and back loses no conversation). A file whose
checksum failed is moved there as ``NAME.damaged``, which no server takes back. :class:`redlite.core.sessions.SessionStore` adds loading, saving and
pruning on top. Not thread-safe (see :mod:`redlite.core.sessions`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from redlite.core.parking import Candidate, candidates_from_index
from redlite.core.prefix_index import DEFAULT_BLOCK, PrefixIndex
from redlite.core.replay import GeneratedTurn
from redlite.core.session_dir import REJECTED, SESSION_NAME, TEMP_NAME, Owners, prepare_session_dir
from redlite.core.session_file import Expected, SessionFileError, check_compatible, read_meta
from redlite.core.session_prune import FileStats

log = logging.getLogger("redlite.sessions")

#: suffix of a file in ``rejected/`` whose header is sound but whose data failed its checksum
DAMAGED = ".damaged"


@dataclass
class DiskEntry:
    """An indexed file: held ids and checkpoint positions from its header (no tensors)."""

    key: str
    path: Path
    held_ids: list[int]
    checkpoint_positions: list[int]
    nbytes: int
    created: float
    last_used: float
    tier: str = field(default="disk")
    session: str | None = None  # the client's session key
    replay: list = field(default_factory=list)  # its exact-replay turns (until the store takes them)


class SessionIndex:
    """The indexed session files of one model in ``directory`` (created mode 0700 when missing).

    expected: what files must match. block: the prefix index's block (tokens). clock: seconds
    since the epoch (tests). The owner lock (:class:`Owners`) is taken by the first write.
    """

    def __init__(self, directory: str | os.PathLike, expected: Expected, *,
                 block: int = DEFAULT_BLOCK, clock=time.time) -> None:
        self.directory = Path(directory)
        self.expected = expected
        self.refusals = 0
        self._clock = clock
        self._entries: dict[str, DiskEntry] = {}
        self._rejected: dict[str, FileStats] = {}  # name in rejected/ -> size, mtime
        self._index = PrefixIndex(block)
        self._owners: Owners | None = None
        self._left_in_place: set[str] = set()  # refused files of live writers: not re-read
        self._seen_mtime, self._seen_at = None, float("-inf")  # the directory at the last look

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def entries(self) -> list[DiskEntry]:
        return list(self._entries.values())

    def rejected(self) -> list[str]:
        """Names of the files in ``rejected/`` (refused at load, kept until pruned)."""
        return sorted(self._rejected)

    @property
    def owners(self) -> Owners:
        if self._owners is None:
            prepare_session_dir(self.directory)
            self._owners = Owners(self.directory)
        return self._owners

    def close(self) -> None:
        """Give up the owner lock (files stay; the next server adopts them)."""
        if self._owners is not None:
            self._owners.close()

    def scan(self) -> None:
        """Index the directory: our files of this model become candidates; others are refused
        (logged) and, when this server may, moved to ``rejected/``; stale temporary files of
        writers no longer alive are removed."""
        owners = self.owners
        owners.remove_stale_locks()
        self._seen_mtime, self._seen_at = self.directory.stat().st_mtime_ns, self._clock()
        for path in sorted(self.directory.iterdir()):
            if TEMP_NAME.match(path.name):
                if owners.may_delete(path.name):
                    try:
                        path.unlink()
                    except OSError:
                        pass
                continue
            if not SESSION_NAME.match(path.name):
                continue
            self._index_file(path)
        rejected_dir = self.directory / REJECTED
        if rejected_dir.is_dir():
            for path in sorted(rejected_dir.iterdir()):
                if SESSION_NAME.match(path.name) and self._take_back(path):
                    continue
                if SESSION_NAME.match(path.name.removesuffix(DAMAGED)):
                    st = path.stat()
                    self._rejected[path.name] = FileStats(path.name, st.st_size, st.st_mtime, True)
        log.info("session dir %s: %d saved conversations indexed (%d bytes), %d rejected",
                 self.directory, len(self._entries), sum(e.nbytes for e in self._entries.values()),
                 len(self._rejected))

    def _take_back(self, path: Path) -> bool:
        """A file in ``rejected/`` whose header this server accepts (refused by a server of
        another model or dtype) is moved back and indexed. True when it was."""
        target = self.directory / path.name
        try:
            check_compatible(read_meta(path)[0], self.expected)
            if target.exists() or not self.owners.may_delete(path.name):
                return False
            os.rename(path, target)
        except (SessionFileError, KeyError, TypeError, ValueError, OSError):
            return False
        log.info("file %s in %s/ matches this model and dtype: moved back", path.name, REJECTED)
        return self._index_file(target)

    def _index_file(self, path: Path) -> bool:
        """Index one session file from its header; a refused one is rejected. True if indexed."""
        try:
            meta, size = read_meta(path)
            check_compatible(meta, self.expected)
            held = [int(t) for t in meta["held_ids"]]
            positions = [int(c["position"]) for c in meta.get("checkpoints") or []]
            replay = [GeneratedTurn.from_record(r) for r in meta.get("replay") or []]
            last_used = path.stat().st_mtime  # set to the last use on save and load
        except SessionFileError as error:
            self._reject(path, error)
            return False
        except (KeyError, TypeError, ValueError, OSError) as error:
            self._reject(path, SessionFileError("corrupt-header", str(error)))
            return False
        self._add(DiskEntry(path.name, path, held, positions, size,
                            float(meta.get("created", 0.0)), last_used,
                            session=meta.get("session"), replay=replay))
        return True

    def refresh(self) -> int:
        """Shared directory: index the files other servers wrote since the last look and
        forget those gone (pruned by their writer). Lists the directory only when its mtime
        changed or a second passed. Returns the files added."""
        now = self._clock()
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            return 0
        if mtime == self._seen_mtime and now - self._seen_at < 1.0:
            return 0
        self._seen_mtime, self._seen_at = mtime, now
        try:
            present = {p.name: p for p in self.directory.iterdir() if SESSION_NAME.match(p.name)}
        except OSError:
            return 0
        for key in [k for k in self._entries if k not in present]:
            self._forget(key)
        added = sum(self._index_file(present[name]) for name in sorted(present)
                    if name not in self._entries and name not in self._left_in_place)
        if added:
            log.info("session dir %s: %d conversations saved by other servers indexed",
                     self.directory, added)
        return added

    def _add(self, entry: DiskEntry) -> None:
        self._entries[entry.key] = entry
        self._index.add(entry.key, entry.held_ids)

    def _forget(self, key: str) -> DiskEntry | None:
        self._index.remove(key)
        return self._entries.pop(key, None)

    def _reject(self, path: Path, error: SessionFileError) -> None:
        """Log a refused file and move it to ``rejected/`` when this server may move it
        (counted in ``refusals``, for the metrics)."""
        self.refusals += 1
        name = path.name
        if not self.owners.may_delete(name):  # another live server's (another model's?) file
            self._left_in_place.add(name)
            log.warning("refused file %s reason=%s (%s); left in place (its writer is running)",
                        name, error.reason, error.detail)
            return
        target = self.directory / REJECTED / (name + DAMAGED if error.reason == "checksum" else name)
        try:
            target.parent.mkdir(mode=0o700, exist_ok=True)
            os.rename(path, target)
            st = target.stat()
        except OSError as move_error:
            log.warning("refused file %s reason=%s (%s); could not move it to %s/: %s", name,
                        error.reason, error.detail, REJECTED, move_error)
            return
        self._rejected[target.name] = FileStats(target.name, st.st_size, st.st_mtime, True)
        log.warning("refused file %s reason=%s (%s); moved to %s/%s", name, error.reason,
                    error.detail, REJECTED, target.name)

    @property
    def block(self) -> int:
        """The prefix index's block (tokens)."""
        return self._index.block

    def hashes_of(self, key: str) -> list[bytes]:
        """The index's chain hashes of file ``key``'s held ids (empty when absent)."""
        return self._index.hashes_of(key)

    def candidates(self, prompt: Sequence[int], can_rewind: bool, best_so_far: int = 0,
                   known: Sequence[bytes] = ()) -> list[Candidate]:
        """Indexed files with a usable prefix for ``prompt`` (see ParkingPool.candidates),
        after a :meth:`refresh`. known: leading chain hashes of ``prompt``."""
        self.refresh()
        return candidates_from_index(self._index, self._entries, prompt, can_rewind, best_so_far,
                                     known=known)
