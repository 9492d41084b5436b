"""GET /v1/responses/{id}/input_items in process (echo engine), through the official ``openai``
SDK: the listed items of string, message and function_call_output inputs, cursor pagination in
both orders, and 404 for unknown, deleted and unstored responses."""

import openai
import pytest

from sdk_app import EchoApp

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client():
    with EchoApp() as app:
        yield openai.OpenAI(base_url=app.url + "/v1", api_key="dummy", http_client=app.client,
                            max_retries=0)


def test_a_string_input_is_one_user_message(client):
    response = client.responses.create(model="m", input="hello", instructions="sys")
    page = client.responses.input_items.list(response.id)
    assert len(page.data) == 1 and not page.has_more
    item = page.data[0]
    assert item.type == "message" and item.role == "user" and item.id.startswith("msg_")
    assert [(c.type, c.text) for c in item.content] == [("input_text", "hello")]
    assert page.first_id == page.last_id == item.id
    # ids are assigned once, when stored
    assert client.responses.input_items.list(response.id).data[0].id == item.id


def test_messages_and_a_function_call_output(client):
    first = client.responses.create(model="m", input="what is the weather?")
    items = [{"role": "developer", "content": "be brief"},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "user", "content": [{"type": "input_text", "text": "so?"}]}]
    second = client.responses.create(model="m", input=items, previous_response_id=first.id)
    listed = client.responses.input_items.list(second.id, order="asc").data
    # only this response's own input, not the previous_response_id chain
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output",
                                              "message"]
    developer, call, output, user = listed
    assert developer.role == "developer" and developer.content[0].text == "be brief"
    assert developer.content[0].type == "input_text"
    assert call.id.startswith("fc_") and call.name == "weather" and call.call_id == "call_1"
    assert output.call_id == "call_1" and output.output == "sunny" and output.status == "completed"
    assert user.content[0].text == "so?" and len({item.id for item in listed}) == 4
    default = client.responses.input_items.list(second.id).data
    assert [item.id for item in default] == [item.id for item in reversed(listed)]


def test_pagination_both_orders(client):
    items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    response = client.responses.create(model="m", input=items)
    texts = lambda page: [item.content[0].text for item in page.data]  # noqa: E731
    for order, expected in (("asc", [f"m{i}" for i in range(5)]),
                            ("desc", [f"m{i}" for i in reversed(range(5))])):
        first = client.responses.input_items.list(response.id, order=order, limit=2)
        assert texts(first) == expected[:2] and first.has_more
        second = client.responses.input_items.list(response.id, order=order, limit=2,
                                                   after=first.last_id)
        assert texts(second) == expected[2:4] and second.has_more
        last = client.responses.input_items.list(response.id, order=order, limit=2,
                                                 after=second.last_id)
        assert texts(last) == expected[4:] and not last.has_more
        # this SDK version has no ``before`` argument; the API takes it as a query parameter
        back = client.responses.input_items.list(response.id, order=order, limit=2,
                                                 extra_query={"before": last.first_id})
        assert texts(back) == expected[2:4]
        # the SDK's auto-pagination follows last_id
        walked = client.responses.input_items.list(response.id, order=order, limit=2)
        assert [item.content[0].text for item in walked] == expected


def test_bad_limit_is_a_400(client):
    response = client.responses.create(model="m", input="x")
    for limit in (0, 101):
        with pytest.raises(openai.BadRequestError):
            client.responses.input_items.list(response.id, limit=limit)


def test_unknown_deleted_and_unstored_are_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.input_items.list("resp_nope")
    assert info.value.body["code"] == "not_found"
    response = client.responses.create(model="m", input="x")
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(response.id)
    unstored = client.responses.create(model="m", input="y", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)


def test_the_store_counts_the_items_bytes():
    from redlite.server.responses_store import ResponseStore
    store = ResponseStore()
    store.put("a", [{"role": "user", "content": "x"}], {"id": "a"})
    bare = store.nbytes
    store.put("a", [{"role": "user", "content": "x"}], {"id": "a"},
              [{"id": "msg_1", "text": "x" * 500}])
    assert store.nbytes >= bare + 500 and len(store) == 1
    store.delete("a")
    assert store.nbytes == 0
