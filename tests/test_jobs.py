"""One queueing path for every engine job (server/jobs.py): chat, completions and the slot API
answer a full queue and a stopping server alike (in process, echo app)."""

import pytest

from echo_app import echo_client
from redlite.core.worker import QueueFull, ShuttingDown

CALLS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
    ("/slots/0?action=erase", {"filename": "x.bin"}),
]


def refusing(error):
    def submit(job):
        raise error
    return submit


@pytest.mark.parametrize("path,body", CALLS)
def test_a_full_queue_is_503_busy_with_retry_after(tmp_path, path, body):
    with echo_client(slot_dir=tmp_path, retry_after_s=7) as client:
        client.state.worker.submit = refusing(QueueFull())
        r = client.post(path, json=body)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "7"
    assert "server busy" in r.text


@pytest.mark.parametrize("path,body", CALLS)
def test_a_stopping_server_is_503_shutting_down(tmp_path, path, body):
    with echo_client(slot_dir=tmp_path) as client:
        client.state.worker.submit = refusing(ShuttingDown())
        r = client.post(path, json=body)
    assert r.status_code == 503, r.text
    assert "retry-after" not in r.headers
    assert "server is shutting down" in r.text


def test_a_job_queued_for_a_caller_that_was_cancelled_meanwhile_is_cancelled():
    """The thread that prepares a chat request queues its job (server/jobs.in_thread): when the
    request's task is cancelled before that thread returns, nobody would read the job's events,
    so the job is cancelled as soon as it exists."""
    import asyncio
    import threading

    from redlite.server.jobs import in_thread

    class Job:
        cancelled = False

        def cancel(self):
            self.cancelled = True
    job, release = Job(), threading.Event()

    def work():
        release.wait(5)
        return job

    async def main():
        task = asyncio.ensure_future(in_thread(work, lambda done: done))
        await asyncio.sleep(0.05)
        task.cancel()
        release.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        for _ in range(100):
            if job.cancelled:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert job.cancelled
    kept, release = Job(), threading.Event()
    release.set()
    assert asyncio.run(in_thread(lambda: kept, lambda done: done)) is kept and not kept.cancelled
