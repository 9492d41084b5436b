"""Engine jobs from the HTTP side: the one place that queues a job on the engine worker (503
``server busy`` with ``Retry-After`` when the queue is full, 503 ``server is shutting down``),
waits for a generation to start, and cancels it when the client leaves."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

from redlite.core.generation_request import GenerationRequest
from redlite.core.worker import Event, Job, QueueFull, ShuttingDown
from redlite.server.access import context_of, note_event
from redlite.server.errors import APIError, as_api_error

RETRY_AFTER_S = 1  # the Retry-After of a 503 "server busy" (seconds)
T = TypeVar("T")


def queue(worker: Any, job: Job, retry_after_s: int = RETRY_AFTER_S) -> None:
    """Put ``job`` on the worker's queue. Raises APIError 503 (busy: queue full; shutting down)."""
    try:
        worker.submit(job)
    except QueueFull:
        raise APIError(503, "server busy", None, "server_busy",
                       {"Retry-After": str(retry_after_s)}) from None
    except ShuttingDown:
        raise APIError(503, "server is shutting down", None, "shutting_down") from None


def enqueue(worker: Any, generation: GenerationRequest, loop: asyncio.AbstractEventLoop,
            scope: dict | None = None, retry_after_s: int = RETRY_AFTER_S) -> tuple[Job, asyncio.Queue]:
    """Queue ``generation`` on ``worker``; its events reach the returned queue on ``loop`` (the
    server's event loop). Callable from any thread: a request thread that has just prepared
    the prompt queues its job at once, without handing back to the event loop first. Each
    finished choice is noted for the access log and the metrics
    (:func:`redlite.server.access.note_event`) of the request whose ASGI ``scope`` is given.
    Raises APIError 503 (see :func:`queue`)."""
    events: asyncio.Queue[Event] = asyncio.Queue()

    def deliver(event: Event) -> None:
        note_event(scope, event)
        loop.call_soon_threadsafe(events.put_nowait, event)

    job = Job(generation, deliver)
    queue(worker, job, retry_after_s)
    if scope is not None:
        context_of(scope).job = job  # the access line waits for it if its client leaves
    return job, events


async def wait_started(job: Job, events: asyncio.Queue, http_request: Any = None) -> None:
    """Wait until ``job`` starts (its ``started`` event: once its prompt work is launched, see
    ``GenerationRequest.launched``). Raises APIError: 499 when ``http_request``'s client left
    while the job waited (the job is cancelled), the job's own error."""
    getter = asyncio.ensure_future(events.get())
    waiters = {getter}
    watcher = None
    if http_request is not None:
        watcher = asyncio.ensure_future(watch_disconnect(http_request, job))
        waiters.add(watcher)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if watcher is not None:
            watcher.cancel()
    if not getter.done():
        getter.cancel()
        raise APIError(499, "client closed the request")
    first: Event = getter.result()
    if first.kind == "error":
        raise as_api_error(first.value)


async def submit(worker: Any, generation: GenerationRequest, http_request: Any = None,
                 retry_after_s: int = RETRY_AFTER_S) -> tuple[Job, asyncio.Queue]:
    """:func:`enqueue` from the event loop, then :func:`wait_started`. Returns the job and the
    queue of its later events."""
    job, events = enqueue(worker, generation, asyncio.get_running_loop(),
                          getattr(http_request, "scope", None), retry_after_s)
    await wait_started(job, events, http_request)
    return job, events


async def in_thread(work: Callable[[], T], job_of: Callable[[T], Job]) -> T:
    """``work()`` in a worker thread (as :func:`asyncio.to_thread`), where it queues a job
    (``job_of(result)``). When the caller is cancelled first, that job is cancelled once
    ``work`` has returned: nobody would read its events."""
    task = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is not None
                               or job_of(t.result()).cancel())
        raise


async def watch_disconnect(http_request: Any, stream: Any) -> None:
    """Cancel ``stream`` (anything with ``cancel()``) when the client closes its connection
    (the body is already read)."""
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            stream.cancel()
            return
