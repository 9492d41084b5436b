"""The disk tier: parked conversations saved as files in ``--session-dir``.

Rules (issue "Conversation parking: RAM pool, disk sessions, slot API, restarts"):

- an entry evicted from RAM holding at least ``min_tokens`` tokens (``--session-min-tokens``)
  is written here (format: :mod:`redlite.core.session_file`), as is the live conversation and
  every parked one on a normal stop;
- on start the directory is indexed from the file headers (no tensor data read); files of
  another model, dtype or format version are refused with the reason logged;
- a file is read and its checksum verified only when it is the best candidate (mapped, its
  checksum computed while the engine copies it in: :class:`ParkedEntry` ``verify``); a
  failure refuses it (logged) and the request runs cold;
- a refused file is moved to ``rejected/`` (:mod:`redlite.core.session_dir`) once, not
  re-indexed at every start; rejected files count against the bounds and go first;
- pruning (:func:`plan_prune`) keeps the newest ``keep`` files (``--session-keep``) and at
  most ``max_bytes`` in all (``--session-max-gb``), counting the session files this server
  may delete (:meth:`Owners.may_delete`: its own, those of owners gone) and the rejected
  ones; it deletes only those, never other files. Servers sharing a directory use each
  other's files, each within its own bounds, and never delete each other's;
- a save that fails (e.g. a full disk) is logged and dropped: it never fails a request.
- a file's header carries the conversation's session key and exact-replay turns (indexed
  with it; :meth:`redlite.core.conversations.Conversations.attach_replay` seeds the store).

Not thread-safe: used from the engine worker thread (and at start/stop, when it is idle).
The parts: :mod:`redlite.core.session_entries` (entry <-> file), :mod:`redlite.core.session_prune`
(what to delete), :mod:`redlite.core.session_index` (the directory's index); this module loads,
saves and prunes (:class:`SessionStore`) and re-exports the parts' names.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any, Sequence

from redlite.core.parking import ParkedEntry
from redlite.core.prefix_index import DEFAULT_BLOCK
from redlite.core.private_files import open_private
from redlite.core.reuse import common_prefix_length
from redlite.core.session_dir import REJECTED, SESSION_NAME, TEMP_NAME  # noqa: F401 (re-exported)
from redlite.core.session_entries import (engine_dtype, entry_from_file, entry_to_file,  # noqa: F401
                                          expected_for)
from redlite.core.session_file import (Expected, SessionFileError, open_state_file,
                                       write_state_file)
from redlite.core.session_index import DiskEntry, SessionIndex
from redlite.core.session_prune import FileStats, plan_prune
from redlite.engine.base import StateSnapshot

log = logging.getLogger("redlite.sessions")


class SessionStore(SessionIndex):
    """Session files of one model in ``directory`` (created mode 0700 when missing): the
    index (:class:`SessionIndex`) plus loading, saving and pruning.

    expected: what files must match (:func:`expected_for`). min_tokens: smallest conversation
    saved (tokens). keep: most files kept. max_bytes: most bytes kept (both count the
    rejected files). ``opener`` (for tests) opens the temporary file being written.
    The first save takes this server's owner lock; :meth:`close` gives it up.
    """

    def __init__(self, directory: str | os.PathLike, expected: Expected, *, min_tokens: int = 512,
                 keep: int = 12, max_bytes: int = 20 << 30, block: int = DEFAULT_BLOCK,
                 opener=open_private, clock=time.time) -> None:
        super().__init__(directory, expected, block=block, clock=clock)
        self.min_tokens, self.keep, self.max_bytes = int(min_tokens), int(keep), int(max_bytes)
        self._opener = opener

    def eligible(self, n_tokens: int) -> bool:
        return n_tokens >= max(1, self.min_tokens)

    def scan(self) -> None:
        """Index the directory (:meth:`SessionIndex.scan`), then apply the bounds."""
        super().scan()
        self.prune()

    # --- load --------------------------------------------------------------------------------

    def load(self, key: str) -> ParkedEntry | None:
        """Map a file and check its header; the entry's ``fill``/``verify`` (called by
        ``install`` before the state is trusted) read it into the engine and verify its
        checksum. None when the file cannot be used; a refused file (here or later) is
        logged, dropped from the index and moved to ``rejected/``. Marks it used (mtime)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            state = open_state_file(entry.path, self.expected)
            parked = entry_from_file(state, key)
            if parked.held_ids != entry.held_ids:
                raise SessionFileError("changed", "file differs from the indexed one")
        except SessionFileError as error:
            self._forget(key)
            self._reject(entry.path, error)
            return None
        def refused(error: SessionFileError) -> None:
            if self._forget(key) is not None:
                self._reject(entry.path, error)

        def fill(engine: Any) -> bool:
            parked.fill = None  # called once; no entry -> fill -> entry cycle, so the file's
            # mapping goes with the entry, not at some later garbage collection
            targets = engine.restore_targets(len(parked.held_ids))
            if not targets:
                state.start_verify()  # verified while the engine copies the mapped state
                return False
            try:
                tensors = state.fill({f"state.{name}": t for name, t in targets.items()})
            except SessionFileError as error:
                refused(error)
                raise
            snapshot = parked.snapshot
            parked.snapshot = StateSnapshot(snapshot.n_past, {name[6:]: t for name, t in tensors.items()
                                                              if name.startswith("state.")},
                                            snapshot.meta, snapshot.tensor_format)
            parked.verify = None
            return True

        def verify() -> None:
            try:
                state.verify()
            except SessionFileError as error:
                refused(error)
                raise

        parked.fill = fill
        parked.verify = verify
        parked.last_used = self._clock()
        self._touch(entry, parked.last_used)
        return parked

    # --- save and prune ----------------------------------------------------------------------

    def save(self, entry: ParkedEntry, *, supersede: bool = False,
             protected: frozenset = frozenset()) -> DiskEntry | None:
        """Write ``entry`` as a new file, then prune. Returns the indexed file, or None when not
        written (logged: too small, a failure, or it would be pruned at once, being older
        than the ``keep`` newest). A file holding the same ids is only marked used.
        ``supersede`` (engines that can rewind): a file that extends this conversation also
        covers it, and files holding a proper prefix of it are deleted once it is written
        (those this server may delete)."""
        ids = entry.held_ids
        if not self.eligible(len(ids)):
            return None
        prefixes, covering = self._relatives(ids, supersede)
        if covering is not None:
            self._touch(covering, max(entry.last_used, covering.last_used))
            return covering
        started = time.perf_counter()
        last_used = entry.last_used or self._clock()
        try:
            self.owners.acquire()  # before the first file this server writes
            name = f"rl-{self.owners.id}-{secrets.token_hex(8)}.rlsession"
            meta, tensors = entry_to_file(entry, self.expected)
            meta["last_used"] = last_used
            estimate = 8 * len(ids) + sum(StateSnapshot(0, {k: v}).nbytes for k, v in tensors.items())
            files = [f for f in self._file_stats() if not (supersede and f.key in prefixes)]
            if name in plan_prune(files + [FileStats(name, estimate, last_used)], self.keep,
                                  self.max_bytes, protected):
                log.info("evicted %d tok reason=session-bounds (not saved: older or larger than "
                         "the kept files)", len(ids))
                return None
            size = write_state_file(self.directory / name, meta, tensors, opener=self._opener)
            os.utime(self.directory / name, (last_used, last_used))  # mtime = last use
        except (OSError, TypeError, ValueError) as error:
            log.warning("save failed %d tok reason=%s (%s)", len(ids),
                        "io" if isinstance(error, OSError) else "encode", error)
            return None
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        log.info("saved %d tok (%d bytes) in %.1f ms file=%s", len(ids), size, elapsed_ms, name)
        saved = DiskEntry(name, self.directory / name, list(ids),
                          [c.position for c in entry.checkpoints if c.tensors is not None],
                          size, entry.created, last_used, session=entry.session)
        if supersede:
            for key in prefixes:
                if key not in protected and self.owners.may_delete(key):
                    self._delete(key, "superseded")
        self._add(saved)
        self.prune(protected | {name})
        return saved

    def _relatives(self, ids: Sequence[int], supersede: bool) -> tuple[list[str], DiskEntry | None]:
        """(files holding a proper prefix of ``ids``, a file covering ``ids``: the same ids,
        or with ``supersede`` any file extending them)."""
        prefixes, covering = [], None
        for group in self._index.lookup(ids):
            for key in group.keys:
                held = self._entries[key].held_ids
                common = common_prefix_length(held, ids)
                if common == len(held) < len(ids):
                    prefixes.append(key)
                elif common == len(ids) and (len(held) == len(ids) or supersede):
                    covering = self._entries[key]
        return prefixes, covering

    def _touch(self, entry: DiskEntry, when: float) -> None:
        entry.last_used = when
        try:
            os.utime(entry.path, (when, when))
        except OSError:
            pass

    def _file_stats(self) -> list[FileStats]:
        """Every file the bounds count: indexed ones this server may delete, then rejected ones
        (keys ``rejected/<name>``). Files of other running servers count against theirs."""
        mine = self._entries.keys() - self._undeletable()
        files = [FileStats(e.key, e.nbytes, e.last_used) for e in self._entries.values()
                 if e.key in mine]
        return files + [FileStats(f"{REJECTED}/{f.key}", f.nbytes, f.last_used, True)
                        for f in self._rejected.values()]

    def _undeletable(self) -> frozenset:
        """Indexed files of other servers still running (they are counted, never deleted)."""
        return frozenset(key for key in self._entries if not self.owners.may_delete(key))

    def prune(self, protected: frozenset = frozenset()) -> list[str]:
        """Delete rejected files, then our least recently used files, beyond ``keep`` /
        ``max_bytes``; returns their keys."""
        victims = plan_prune(self._file_stats(), self.keep, self.max_bytes, protected)
        for key in victims:
            if key.startswith(f"{REJECTED}/"):
                name = key[len(REJECTED) + 1:]
                stats = self._rejected.pop(name)
                try:
                    (self.directory / REJECTED / name).unlink()
                except OSError as error:
                    log.warning("could not delete %s/%s: %s", REJECTED, name, error)
                    continue
                log.info("deleted rejected file %s (%d bytes) reason=prune", name, stats.nbytes)
            else:
                self._delete(key, "prune")
        return victims

    def _delete(self, key: str, reason: str) -> None:
        entry = self._forget(key)
        if entry is None:
            return
        try:
            entry.path.unlink()
        except OSError as error:
            log.warning("could not delete %s: %s", entry.path.name, error)
            return
        log.info("evicted %d tok from disk reason=%s file=%s", len(entry.held_ids), reason, key)
