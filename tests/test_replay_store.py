"""The replay store and matching rules (pure, torch-free)."""

from __future__ import annotations

from redlite.core.replay import GeneratedTurn, ReplayStore, canonical_arguments, context_key, matches
from redlite.core.replay_splice import header_start

USER = {"role": "user", "content": "do it"}


def turn(content="", reasoning="", calls=(), context=USER, answer=(1, 2, 3)):
    return GeneratedTurn([9], "<|im_start|>assistant\n", list(answer), content, reasoning,
                         tuple(calls), context_key(context))


def call_message(arguments, call_id="call_1", **extra):
    return {"role": "assistant", "content": "", **extra, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "f", "arguments": arguments}}]}


def test_arguments_compare_as_json():
    assert canonical_arguments('{"b": 1,  "a": [1, 2]}') == canonical_arguments('{"a":[1,2],"b":1}')
    assert canonical_arguments('{"a": 1}') != canonical_arguments('{"a": 2}')
    assert canonical_arguments(" not json ") == "not json"


def test_matching_rules():
    kept = turn("done", "I think", [("call_1", "f", canonical_arguments('{"a": 1, "b": 2}'))])
    assert matches(call_message('{"b":2,"a":1}', content="done"), kept)
    assert matches(call_message('{"b":2,"a":1}', content="done ", reasoning_content="I think"), kept)
    assert not matches(call_message('{"b":2,"a":1}', content="done", reasoning_content="other"), kept)
    assert not matches(call_message('{"a":1,"b":3}', content="done"), kept)
    assert not matches({"role": "user", "content": "done"}, kept)


def test_store_finds_by_call_id_and_by_content_with_context():
    store = ReplayStore()
    by_call = turn("", calls=[("call_x", "f", canonical_arguments('{"a": 1}'))])
    plain = turn("hello", context={"role": "user", "content": "hi"})
    store.record(by_call)
    store.record(plain)
    assert store.find(call_message('{"a": 1}', call_id="call_x")) is by_call
    assert store.find(call_message('{"a": 1}', call_id="call_y"), USER) is by_call  # by content
    assert store.find({"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}) is plain
    # the same answer to another message is another turn
    assert store.find({"role": "assistant", "content": "hello"}, USER) is None


def test_store_is_bounded_least_recently_used_first_out():
    first, second = turn("one", answer=range(100)), turn("two", answer=range(100))
    store = ReplayStore(first.nbytes + second.nbytes + 10)
    store.record(first)
    store.record(second)
    assert store.find({"role": "assistant", "content": "one"}, USER) is first  # now most recent
    store.record(turn("three", answer=range(100)))
    assert len(store) == 2 and store.nbytes <= store.budget_bytes
    assert store.find({"role": "assistant", "content": "two"}, USER) is None
    assert store.find({"role": "assistant", "content": "one"}, USER) is first


def test_header_is_the_longest_start_of_the_generation_prompt():
    before = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert before[header_start(before, "<|im_start|>assistant\n<think>\n"):].startswith(
        "<|im_start|>assistant\n<think>\n")
    plain = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert header_start(plain, "<|im_start|>assistant\n<think>\n") == plain.index("<|im_start|>assistant")
    assert header_start("<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>assistant\n") is None


def test_context_keys_are_remembered_within_a_text_budget():
    from redlite.core.replay import _context_digest, _Digests, context_key

    digests = _Digests(max_chars=10)
    assert digests.get(("user", None, "hello")) == _context_digest("user", None, "hello")
    assert digests.get(("tool", "c1", "hello")) == _context_digest("tool", "c1", "hello")
    assert digests.chars == 10 and len(digests._digests) == 2
    digests.get(("user", None, "x" * 11))  # over the budget on its own: nothing else kept either
    assert digests.chars <= 10 and ("user", None, "hello") not in digests._digests
    message = {"role": "user", "content": "same text"}
    assert context_key(message) == context_key(dict(message)) == _context_digest("user", None, "same text")
    assert context_key({**message, "role": "tool"}) != context_key(message)
