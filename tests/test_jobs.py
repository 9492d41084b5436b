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
