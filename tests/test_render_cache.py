"""The rendered-prompt cache (redlite.loading.render_cache): the same input gives back the same
prompt; any input a template could tell apart renders again; it stays within its bounds."""

import pytest

from redlite.loading.render_cache import RenderCache

pytestmark = pytest.mark.timeout(60)


class Prompt:
    def __init__(self, text):
        self.text = text


def counting_cache(**bounds):
    cache, calls = RenderCache(**bounds), []

    def get(messages, extra=None):
        text = "".join(str(m.get("content")) for m in messages)
        return cache.get_or_render(messages, extra, lambda: calls.append(1) or Prompt(text))
    return cache, calls, get


def test_same_input_same_prompt_other_input_renders_again():
    _, calls, get = counting_cache()
    user = [{"role": "user", "content": "hi"}]
    first = get(user, ({"enable_thinking": False}, 100))
    assert get([{"role": "user", "content": "hi"}], ({"enable_thinking": False}, 100)) is first
    assert len(calls) == 1
    others = [
        (user, ({"enable_thinking": True}, 100)),
        (user, ({"enable_thinking": False}, 99)),  # e.g. another prompt limit
        ([{"content": "hi", "role": "user"}], ({"enable_thinking": False}, 100)),  # key order
        ([{"role": "user", "content": ["hi"]}], ({"enable_thinking": False}, 100)),
        ([{"role": "user", "content": ("hi",)}], ({"enable_thinking": False}, 100)),  # tuple
        ([{"role": "user", "content": 1}], ({"enable_thinking": False}, 100)),
        ([{"role": "user", "content": True}], ({"enable_thinking": False}, 100)),
        ([{"role": "user", "content": 1.0}], ({"enable_thinking": False}, 100)),
        ([{"role": "user", "content": -0.0}], ({"enable_thinking": False}, 100)),
        ([{"role": "user", "content": 0.0}], ({"enable_thinking": False}, 100)),
        ([{"role": "user", "content": [["role", "user"]]}], ({"enable_thinking": False}, 100)),
        ([{"role": "user", "content": {"role": "user"}}], ({"enable_thinking": False}, 100)),
    ]
    rendered = [get(m, e) for m, e in others]
    assert len(calls) == 1 + len(others) and len({id(r) for r in rendered}) == len(others)


def test_values_without_a_faithful_repr_are_not_cached():
    class Text(str):
        pass

    _, calls, get = counting_cache()
    get([{"role": "user", "content": Text("hi")}])
    get([{"role": "user", "content": Text("hi")}])
    get([{"role": "user", "content": "hi"}], ({"tools": [object()]},))
    get([{"role": "user", "content": "hi"}], ({"tools": [object()]},))
    assert len(calls) == 4


def test_failures_are_not_kept_and_bounds_hold():
    cache, calls, get = counting_cache(max_entries=2, max_chars=200)

    def fail():
        raise ValueError("template refused")
    with pytest.raises(ValueError):
        cache.get_or_render([], None, fail)
    a, b, c = ([{"role": "user", "content": x}] for x in "abc")
    get(a), get(b), get(a), get(c)  # c pushes out b, the least recently used
    assert len(calls) == 3
    get(a), get(b)
    assert len(calls) == 4
    get([{"role": "user", "content": "x" * 300}])  # its text is larger than max_chars: not kept
    get([{"role": "user", "content": "x" * 300}])
    assert len(calls) == 6
    cache.clear()
    get(a)
    assert len(calls) == 7
