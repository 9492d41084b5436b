"""Responses requests against the OpenAI API's rules, in process (echo engine), through the
official ``openai`` SDK and raw HTTP: ``input_tokens`` counts prompts of any length."""

import openai
import pytest

from sdk_app import EchoApp


def sdk(app):
    return openai.OpenAI(base_url=app.url + "/v1", api_key="dummy", http_client=app.client, max_retries=0)


@pytest.mark.timeout(30)
def test_input_tokens_counts_a_prompt_longer_than_the_context():
    """It was a 400 ``context_length_exceeded``: a count answers any length; creating the
    response is what refuses it. Other errors stay (an unknown previous response is a 404)."""
    with EchoApp(max_context=64) as small:
        client = sdk(small)
        counted = client.responses.input_tokens.count(model="m", input="y" * 200)
        assert counted.input_tokens > 64 and small.engine.prefilled_tokens == 0
        short = client.responses.input_tokens.count(model="m", input="y" * 20)
        assert counted.input_tokens - short.input_tokens == 180
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", input="y" * 200)
        assert info.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError):
            client.responses.input_tokens.count(model="m", input="y" * 200, previous_response_id="resp_gone")
