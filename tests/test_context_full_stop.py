"""An answer cut because the context is full, before its ``max_tokens``, in process (echo
engine, a 64-token context), through the official ``anthropic`` SDK: Anthropic's stop reason
``model_context_window_exceeded``, streamed or not; ``max_tokens`` stays for a cut at the
request's limit. A client that continues a ``max_tokens`` answer would be cut again at once."""

import anthropic
import pytest

from sdk_app import EchoApp

TEXT = "0123456789 abcdefghij 0123456789 abcdefghij"


@pytest.fixture
def small():
    with EchoApp(max_context=64) as app:
        yield app


def answer(app, stream, max_tokens):
    client = anthropic.Anthropic(base_url=app.url, api_key="dummy", http_client=app.client, max_retries=0)
    fields = dict(model="m", max_tokens=max_tokens, messages=[{"role": "user", "content": TEXT}])
    if not stream:
        return client.messages.create(**fields)
    with client.messages.stream(**fields) as events:
        return events.get_final_message()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_context_is_not_reported_as_max_tokens(small, stream):
    """It said ``max_tokens`` with 19 of 500 tokens written (46 + 19 fill 64, the last one not fed)."""
    cut = answer(small, stream, 500)
    usage = cut.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens >= 64
    assert usage.output_tokens < 500 and cut.stop_reason == "model_context_window_exceeded"
    assert TEXT.startswith(cut.content[0].text)
    limited = answer(small, stream, 5)
    assert limited.usage.output_tokens == 5 and limited.stop_reason == "max_tokens"
