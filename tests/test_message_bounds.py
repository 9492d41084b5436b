"""Message boundaries from a constant number of renders (redlite.loading.message_bounds),
checked against the quadratic definition (one render per prefix) on several template shapes."""

import jinja2
import pytest

from redlite.core.tokenizer import min_prompt_tokens
from redlite.loading.message_bounds import message_boundaries


def _raise(message):
    raise jinja2.TemplateError(message)


CHATML_DEFAULT_SYSTEM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3_TRIM = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# consecutive tool results share one user turn, as Qwen's templates do; tools= is rendered
TOOLS = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | join(',') }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>{{ call }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# refuses any conversation that does not end with a user message
USER_LAST = (
    "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('last must be user') }}{% endif %}"
    + CHATML_DEFAULT_SYSTEM)

# inspects the content: markers change what it renders
INSPECTS = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if m['content'].endswith('!') %} (loud){% endif %}</>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def renderer(template: str, counter: list | None = None, **kwargs):
    compiled = jinja2.Environment().from_string(template)

    def render(messages, add_generation_prompt):
        if counter is not None:
            counter.append(len(messages))
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               raise_exception=_raise, **kwargs)
    return render


def reference(render, messages, text):
    """The quadratic definition: len(render(messages[:i+1])) when that is a prefix of text."""
    ends = []
    for i in range(len(messages)):
        try:
            prefix = render(messages[: i + 1], False)
        except jinja2.TemplateError:
            continue
        if text.startswith(prefix) and (not ends or len(prefix) > ends[-1]):
            ends.append(len(prefix))
    return ends


def conversation(n):
    roles = ["user", "assistant"]
    return [{"role": "system", "content": "be brief"}] + [
        {"role": roles[i % 2], "content": f"message {i}  \n" if i % 3 == 0 else f"m{i}"} for i in range(n)]


AGENT = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "fix the bug"},
    {"role": "assistant", "content": "Looking.", "tool_calls": ["read(a.py)"]},
    {"role": "tool", "content": "def f(): pass"},
    {"role": "assistant", "content": "", "tool_calls": ["read(b.py)", "read(c.py)"]},
    {"role": "tool", "content": "x = 1"},
    {"role": "tool", "content": "y = 2"},
    {"role": "assistant", "content": "Done: the bug was in f."},
    {"role": "user", "content": "thanks"},
]


@pytest.mark.parametrize("template", [CHATML_DEFAULT_SYSTEM, LLAMA3_TRIM])
@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_equal_to_the_prefix_definition(template, n):
    messages = conversation(n)
    counter = []
    render = renderer(template, counter)
    text = render(messages, True)
    counter.clear()
    got = message_boundaries(render, messages, text)
    rendered_messages = sum(counter)
    assert got == reference(render, messages, text)
    assert len(got) == len(messages)  # every message has its boundary
    assert rendered_messages <= len(messages) + 12  # one full render plus short prefixes


def test_every_message_of_a_plain_chatml_conversation_has_its_boundary():
    messages = conversation(12)
    render = renderer(CHATML_DEFAULT_SYSTEM)
    text = render(messages, True)
    got = message_boundaries(render, messages, text)
    assert len(got) == len(messages)
    assert all(text[:end].endswith("<|im_end|>\n") for end in got)


def test_tool_conversation_with_template_kwargs():
    render = renderer(TOOLS, tools=["read", "write"])
    text = render(AGENT, True)
    assert text.startswith("<|im_start|>system\ntools: read,write")
    got = message_boundaries(render, AGENT, text)
    # tool calls written after the content, a tool-call turn with empty content: all found;
    # a tool result followed by another one is inside a shared turn: no boundary, by definition
    assert got == reference(render, AGENT, text)
    assert len(render(AGENT[:6], False)) not in got


def test_template_refusing_partial_conversations():
    messages = conversation(5)
    messages[-1]["role"] = "user"
    render = renderer(USER_LAST)
    text = render(messages, True)
    got = message_boundaries(render, messages, text)
    assert got == reference(render, messages, text)


def test_content_inspecting_template_falls_back_to_exact_boundaries_only():
    messages = [{"role": "user", "content": "hi!"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "bye!"}]
    render = renderer(INSPECTS)
    text = render(messages, True)
    got = message_boundaries(render, messages, text)
    assert got and set(got) <= set(reference(render, messages, text))
    assert got[-1] == len(render(messages, False))


@pytest.mark.parametrize("lead", ["\u2063", "\x07"])
def test_marker_text_in_content_cannot_be_confused_with_a_marker(lead):
    messages = [{"role": "user", "content": f"{lead}<abc:0> and {lead}<def:o1> {lead}<12:c0>"},
                {"role": "assistant", "content": f"ok {lead}"}]
    render = renderer(CHATML_DEFAULT_SYSTEM)
    text = render(messages, True)
    assert message_boundaries(render, messages, text) == reference(render, messages, text)


def test_empty_conversation():
    render = renderer(CHATML_DEFAULT_SYSTEM)
    assert message_boundaries(render, [], render([], True)) == []


def test_min_prompt_tokens_is_a_lower_bound():
    assert min_prompt_tokens(["abc", None, "de"], 2) == 3
    assert min_prompt_tokens(["x" * 100], None) == 0
    assert min_prompt_tokens([], 4) == 0
