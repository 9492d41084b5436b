"""The llama.cpp-compatible slot API: save, restore and erase a slot's live conversation.

``POST /slots/{id}?action=save`` (id: a sequence slot, 0 to ``--parallel`` - 1) ``{"filename": "x.bin"}`` ->
``{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}``;
``action=restore`` -> ``{"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}``;
``action=erase`` -> ``{"id_slot", "n_erased"}`` (as llama.cpp's ``/slots/{id}`` endpoint).
Every action takes the JSON body ``{"filename": ...}`` (erase checks the name and ignores it:
one documented body for the route, and no cross-site form post can reach it).
n_saved/n_restored/n_erased count tokens, n_written/n_read bytes, times are in ms.

Enabled only with ``--slot-save-path DIR`` (else 501). Files are the session format
(:mod:`redlite.core.session_file`), created 0600 in a 0700 directory: a file of another model
is refused on restore (400), a missing one is a 404.
A filename must be a plain name inside that directory (:func:`validate_filename`), else 400.
Error messages name the file only by its given name; paths and OS errors go to the log.
The operations run on the engine worker thread between generations: each is queued as an
:class:`~redlite.core.generation_request.EngineTask` like a request (503 when the queue is full).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request

from redlite.core.live_state import capture, install, reset
from redlite.core.generation import Generator
from redlite.core.generation_request import EngineTask
from redlite.core.session_file import (Expected, SessionFileError, read_state_file,
                                       write_state_file)
from redlite.core.session_format import MISMATCH_REASONS
from redlite.core.sessions import SESSION_NAME, entry_from_file, entry_to_file
from redlite.core.worker import EngineWorker, Job, ShuttingDown
from redlite.server.errors import APIError
from redlite.server.jobs import RETRY_AFTER_S, queue
from redlite.server.security import require_json

log = logging.getLogger("redlite.slots")

MAX_FILENAME = 128
_FILENAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # matched against the whole name


def validate_filename(name: Any) -> str:
    """Return ``name`` if it is a plain file name: a str of 1-128 characters from
    ``[A-Za-z0-9._-]`` starting with a letter or digit (so no path separator, no leading dot),
    without ``..``, and not a session file name (``rl-*.rlsession``, which pruning owns).
    Raises ValueError with the reason otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError("filename must be a non-empty string")
    if len(name) > MAX_FILENAME:
        raise ValueError(f"filename longer than {MAX_FILENAME} characters")
    if not _FILENAME.fullmatch(name):
        raise ValueError("filename may hold only letters, digits, '.', '_' and '-', "
                         "and must start with a letter or digit")
    if ".." in name:
        raise ValueError("filename must not contain '..'")
    if SESSION_NAME.match(name):
        raise ValueError("filename is reserved for session files")
    return name


class SlotError(Exception):
    """A slot operation refused: ``status`` and message for the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SlotService:
    """Slot operations on files in ``directory`` for the generator behind ``worker``.
    expected: what restored files must match (``redlite.core.sessions.expected_for``)."""

    directory: Path
    worker: EngineWorker
    expected: Expected

    def path_of(self, name: Any) -> Path:
        """The file for ``name`` inside the directory. Raises SlotError(400)."""
        try:
            name = validate_filename(name)
        except ValueError as error:
            raise SlotError(400, f"invalid filename: {error}") from None
        path = self.directory / name
        if path.is_symlink() or path.resolve().parent != self.directory.resolve():
            raise SlotError(400, "invalid filename: not a plain file in the slot directory")
        return path

    # --- run on the engine worker thread -----------------------------------------------------

    def save(self, gen: Generator, path: Path, slot: int = 0) -> dict:
        if gen.failed:
            raise SlotError(409, "the slot's state is not consistent (its last request failed)")
        started = time.perf_counter()
        entry = capture(gen, "slot", time.time())
        meta, tensors = entry_to_file(entry, self.expected)
        try:
            written = write_state_file(path, meta, tensors)
        except OSError as error:
            log.error("slot save %s failed: %s", path.name, error)
            raise SlotError(500, f"could not write {path.name}") from None
        ms = (time.perf_counter() - started) * 1000.0
        log.info("slot save %s: saved %d tok (%d bytes) in %.1f ms", path.name, len(entry.held_ids),
                 written, ms)
        return {"id_slot": slot, "filename": path.name, "n_saved": len(entry.held_ids),
                "n_written": written, "timings": {"save_ms": ms}}

    def restore(self, gen: Generator, path: Path, slot: int = 0) -> dict:
        started = time.perf_counter()
        if not path.is_file():
            raise SlotError(404, f"slot file not found: {path.name}")
        try:
            state = read_state_file(path, self.expected)
            entry = entry_from_file(state, "slot")
        except SessionFileError as error:
            log.warning("refused file %s reason=%s (%s)", path.name, error.reason, error.detail)
            said = f" ({error.detail})" if error.reason in MISMATCH_REASONS else ""  # no paths or OS text
            raise SlotError(400, f"cannot restore {path.name}: {error.reason}{said}") from None
        parking = gen.parking
        if parking is not None and not gen.failed and gen.held_ids and gen.held_ids != entry.held_ids:
            parking.park_live(gen, frozenset())
        if not install(gen, entry):
            raise SlotError(500, f"restoring {path.name} failed; the slot was erased")
        ms = (time.perf_counter() - started) * 1000.0
        log.info("slot restore %s: restored from file %d tok in %.1f ms", path.name,
                 len(entry.held_ids), ms)
        return {"id_slot": slot, "filename": path.name, "n_restored": len(entry.held_ids),
                "n_read": state.nbytes, "timings": {"restore_ms": ms}}

    @staticmethod
    def erase(gen: Generator, slot: int = 0) -> dict:
        n_erased = reset(gen)
        log.info("slot erase: %d tok dropped", n_erased)
        return {"id_slot": slot, "n_erased": n_erased}

    # --- from the HTTP side ------------------------------------------------------------------

    async def run(self, action: Callable[[Generator], dict], name: str,
                  retry_after_s: int = RETRY_AFTER_S, slot: int = 0) -> dict:
        """Queue ``action`` on the engine worker, for sequence slot ``slot``, and wait for it.
        Raises APIError."""
        failures: list[BaseException] = []

        def deliver(event) -> None:
            if event.kind == "error":
                failures.append(event.value)

        task = EngineTask(prompt_ids=[], action=action, request_id=f"slot-{name}", slot=slot)
        job = Job(task, deliver)
        queue(self.worker, job, retry_after_s)
        await asyncio.to_thread(job.finished.wait)
        error = task.error or (failures[0] if failures else None)
        if isinstance(error, SlotError):
            raise APIError(error.status, str(error))
        if isinstance(error, ShuttingDown):
            raise APIError(503, "server is shutting down", None, "shutting_down")
        if error is not None:
            log.error("slot %s failed: %s: %s", name, type(error).__name__, error)
            raise APIError(500, f"slot {name} failed")
        return task.result


def mount_slot_routes(app: FastAPI, state: Any) -> None:
    """Add ``POST /slots/{id_slot}`` to ``app``; ``state.slots`` is a SlotService or None
    (disabled: 501)."""

    @app.post("/slots/{id_slot}")
    async def slots(id_slot: str, request: Request, action: str | None = None) -> Any:
        service: SlotService | None = getattr(state, "slots", None)
        if service is None:
            raise APIError(501, "the slot API is disabled: start the server with --slot-save-path DIR")
        slots_held = len(service.worker.generators)
        if not (id_slot.isdigit() and int(id_slot) < slots_held and id_slot == str(int(id_slot))):
            raise APIError(400, f"invalid slot id {id_slot!r}: this server has slots 0 to "
                           f"{slots_held - 1}", "id_slot")
        slot = int(id_slot)
        require_json(request.headers)  # no cross-site "simple" POST may erase or write
        if action not in ("save", "restore", "erase"):
            raise APIError(400, "action must be save, restore or erase", "action")
        try:
            body = json.loads(await request.body() or b"{}")
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise APIError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:  # every action takes the same body (erase checks the filename, then ignores it)
            path = service.path_of(body.get("filename"))
        except SlotError as error:
            raise APIError(error.status, str(error), "filename") from None
        if action == "erase":
            return await service.run(lambda gen: service.erase(gen, slot), action,
                                     state.retry_after_s, slot)
        method = service.save if action == "save" else service.restore
        return await service.run(lambda gen: method(gen, path, slot), action, state.retry_after_s,
                                 slot)
