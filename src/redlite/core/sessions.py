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
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Sequence

from redlite.core.parking import (Candidate, ParkedCheckpoint, ParkedEntry,
                                  candidates_from_index, tensor_nbytes)
from redlite.core.prefix_index import DEFAULT_BLOCK, PrefixIndex
from redlite.core.private_files import open_private
from redlite.core.replay import GeneratedTurn
from redlite.core.reuse import common_prefix_length
from redlite.core.session_dir import (REJECTED, SESSION_NAME, TEMP_NAME, Owners,
                                      prepare_session_dir)
from redlite.core.session_file import (Expected, SessionFileError, StateFile, check_compatible,
                                       open_state_file, read_meta, write_state_file)
from redlite.engine.base import StateSnapshot

log = logging.getLogger("redlite.sessions")


# --- entry <-> file ----------------------------------------------------------------------------

def engine_dtype(engine: Any) -> str:
    """The compute dtype an engine names in its files (``"none"`` for the echo engine)."""
    return str(getattr(engine, "dtype", "none")).removeprefix("torch.")


def expected_for(engine: Any) -> Expected:
    """What this engine's files carry. Probes ``engine.snapshot()`` for its tensor format, so
    call it while the engine holds no conversation (at start)."""
    return Expected(engine.fingerprint(), engine_dtype(engine), engine.snapshot().tensor_format)


def entry_to_file(entry: ParkedEntry, expected: Expected) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, tensors) of ``entry`` for :func:`write_state_file`. Checkpoints held only as
    engine objects (no host form) are left out."""
    snapshot = entry.snapshot
    tensors = {f"state.{name}": array for name, array in snapshot.tensors.items()}
    checkpoints = []
    for i, c in enumerate(c for c in entry.checkpoints if c.tensors is not None):
        names = []
        for name, array in c.tensors.items():
            tensors[f"ckpt.{i}.{name}"] = array
            names.append(name)
        checkpoints.append({"position": c.position, "turn_boundary": c.turn_boundary,
                            "nbytes": c.nbytes, "meta": c.meta or {}, "tensors": names})
    meta = {"fingerprint": expected.fingerprint, "dtype": expected.dtype,
            "tensor_format": snapshot.tensor_format,
            "layout": str(snapshot.meta.get("layout", "")), "n_past": snapshot.n_past,
            "held_ids": [int(t) for t in entry.held_ids], "engine_meta": snapshot.meta,
            "checkpoints": checkpoints, "created": entry.created, "last_used": entry.last_used,
            "session": entry.session, "replay": [t.to_record() for t in entry.replay]}
    return meta, tensors


def entry_from_file(state: StateFile, key: Hashable) -> ParkedEntry:
    """The :class:`ParkedEntry` (tier ``disk``) in a verified file. Raises SessionFileError
    ("corrupt-header") when the metadata are inconsistent."""
    meta = state.meta
    try:
        held = [int(t) for t in meta["held_ids"]]
        n_past = int(meta["n_past"])
        if n_past != len(held):
            raise ValueError(f"n_past {n_past} != {len(held)} held ids")
        snapshot = StateSnapshot(n_past, {name[6:]: array for name, array in state.tensors.items()
                                          if name.startswith("state.")},
                                 dict(meta.get("engine_meta") or {}), meta["tensor_format"])
        checkpoints = []
        for i, c in enumerate(meta.get("checkpoints") or []):
            payload = {name: state.tensors[f"ckpt.{i}.{name}"] for name in c["tensors"]}
            checkpoints.append(ParkedCheckpoint(int(c["position"]), bool(c["turn_boundary"]),
                                                tensor_nbytes(payload), payload, dict(c["meta"])))
        replay = [GeneratedTurn.from_record(r) for r in meta.get("replay") or []]
    except (KeyError, ValueError, TypeError) as error:
        raise SessionFileError("corrupt-header", f"inconsistent metadata: {error}") from None
    return ParkedEntry(key, held, snapshot, checkpoints, float(meta.get("created", 0.0)),
                       float(meta.get("last_used", 0.0)), tier="disk",
                       session=meta.get("session"), replay=replay)


# --- pruning (pure) ----------------------------------------------------------------------------

@dataclass(frozen=True)
class FileStats:
    key: Hashable
    nbytes: int
    last_used: float
    rejected: bool = False


def plan_prune(files: Sequence[FileStats], keep: int, max_bytes: int,
               protected: frozenset = frozenset()) -> list[Hashable]:
    """Keys of the files to delete, rejected ones first, then least recently used first, so
    that at most ``keep`` files and ``max_bytes`` bytes remain; protected keys are never
    chosen (the result may then still exceed the bounds)."""
    order = sorted(files, key=lambda f: (not f.rejected, f.last_used))
    count, total = len(files), sum(f.nbytes for f in files)
    victims = []
    for f in order:
        if count <= keep and total <= max_bytes:
            break
        if f.key in protected:
            continue
        victims.append(f.key)
        count, total = count - 1, total - f.nbytes
    return victims


# --- the store ---------------------------------------------------------------------------------

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


class SessionStore:
    """Session files of one model in ``directory`` (created mode 0700 when missing).

    expected: what files must match (:func:`expected_for`). min_tokens: smallest conversation
    saved (tokens). keep: most files kept. max_bytes: most bytes kept (both count the
    rejected files). ``opener`` (for tests) opens the temporary file being written.
    The first save takes this server's owner lock; :meth:`close` gives it up.
    """

    def __init__(self, directory: str | os.PathLike, expected: Expected, *, min_tokens: int = 512,
                 keep: int = 12, max_bytes: int = 20 << 30, block: int = DEFAULT_BLOCK,
                 opener=open_private, clock=time.time) -> None:
        self.directory = Path(directory)
        self.expected = expected
        self.min_tokens, self.keep, self.max_bytes = int(min_tokens), int(keep), int(max_bytes)
        self.refusals = 0
        self._opener, self._clock = opener, clock
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

    def eligible(self, n_tokens: int) -> bool:
        return n_tokens >= max(1, self.min_tokens)

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

    # --- index -------------------------------------------------------------------------------

    def scan(self) -> None:
        """Index the directory: our files of this model become candidates; others are refused
        (logged) and, when this server may, moved to ``rejected/``; stale temporary files of
        writers no longer alive are removed; then the bounds are applied."""
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
            for path in rejected_dir.iterdir():
                if SESSION_NAME.match(path.name):
                    st = path.stat()
                    self._rejected[path.name] = FileStats(path.name, st.st_size, st.st_mtime, True)
        log.info("session dir %s: %d saved conversations indexed (%d bytes), %d rejected",
                 self.directory, len(self._entries), sum(e.nbytes for e in self._entries.values()),
                 len(self._rejected))
        self.prune()

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
        target = self.directory / REJECTED / name
        try:
            target.parent.mkdir(mode=0o700, exist_ok=True)
            os.rename(path, target)
            st = target.stat()
        except OSError as move_error:
            log.warning("refused file %s reason=%s (%s); could not move it to %s/: %s", name,
                        error.reason, error.detail, REJECTED, move_error)
            return
        self._rejected[name] = FileStats(name, st.st_size, st.st_mtime, True)
        log.warning("refused file %s reason=%s (%s); moved to %s/", name, error.reason,
                    error.detail, REJECTED)

    def candidates(self, prompt: Sequence[int], can_rewind: bool, best_so_far: int = 0) -> list[Candidate]:
        """Indexed files with a usable prefix for ``prompt`` (see ParkingPool.candidates),
        after a :meth:`refresh`."""
        self.refresh()
        return candidates_from_index(self._index, self._entries, prompt, can_rewind, best_so_far)

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
