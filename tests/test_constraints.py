"""Constrained decoding: the grammar builder (core/constraints.py), the llguidance matcher
(core/grammar.py) and generation through the echo engine's sampler."""

import json

import jsonschema
import pytest

from redlite.core.byte_tokenizer import END, ByteTokenizer
from redlite.core.constraints import ConstraintError, build_constraint
from redlite.core.chat import OutputEvent
from redlite.core.generation import GenerationRequest, GenerationResult, Generator
from redlite.core.grammar import GrammarMatcher, check_constraint, grammar_tokenizer
from redlite.engine.base import SamplingParams
from redlite.engine.echo import EchoEngine

tok = ByteTokenizer()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}


def accepts(spec, text):
    """Whether the grammar accepts ``text`` whole (every byte allowed, then end of turn)."""
    matcher = GrammarMatcher(spec, grammar_tokenizer(tok))
    for byte in text.encode():
        if not matcher.allowed(260)[byte]:
            return False
        matcher.accept(byte)
    return bool(matcher.allowed(260)[END])


def generate(user, spec, max_tokens=200):
    gen = Generator(EchoEngine(), tok)
    prompt = tok.render_chat([{"role": "user", "content": user}]).token_ids
    items = list(gen.run(GenerationRequest(prompt, max_tokens, SamplingParams(constraint=spec))))
    result = items[-1]
    assert isinstance(result, GenerationResult)
    return "".join(i.value for i in items if isinstance(i, OutputEvent)), result.finish_reason


def test_no_constraint_for_free_output():
    assert build_constraint(None) is None
    assert build_constraint({"type": "text"}, TOOLS, "none", "hermes") is None
    assert build_constraint(None, TOOLS, "auto", None) is None  # no known format
    assert build_constraint(None, TOOLS, "auto", "llama3_json") is None  # no opening tag


@pytest.mark.parametrize("fields, param", [
    (({"type": "xml"},), "response_format"),
    (({"type": "json_schema", "json_schema": {"schema": [1]}},), "response_format"),
    ((None, TOOLS, "missing", "hermes"), "tool_choice"),
    ((None, [], "required", "hermes"), "tool_choice"),
    ((None, TOOLS, "required", "yaml"), "tool_format"),
])
def test_builder_errors_name_the_field(fields, param):
    with pytest.raises(ConstraintError) as info:
        build_constraint(*fields)
    assert info.value.param == param


def test_invalid_schema_is_reported():
    spec = build_constraint({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
    with pytest.raises(ConstraintError) as info:
        check_constraint(spec, tok)
    assert info.value.param == "response_format"


def test_json_schema_grammar():
    spec = build_constraint(SCHEMA_FORMAT)
    assert accepts(spec, '{"city": "Paris", "days": 3}')
    assert not accepts(spec, '{"city": 3}')
    assert not accepts(spec, '{"days": 3}')  # city is required
    assert not accepts(spec, '{"city": "Paris", "x": 1}')
    assert not accepts(spec, 'Sure! {"city": "Paris"}')
    assert accepts(build_constraint({"type": "json_object"}), '{"any": [1, {"b": null}]}')
    assert not accepts(build_constraint({"type": "json_object"}), '[1]')


def test_hermes_forced_call():
    named = build_constraint(None, TOOLS, "get_weather", "hermes")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    assert accepts(named, call)
    assert not accepts(named, call.replace('"c"', '"k"'))
    assert not accepts(named, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert not accepts(named, "I will call it. " + call)
    assert not accepts(named, call + "\n" + call)  # a named function is called once
    required = build_constraint(None, TOOLS, "required", "hermes")
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert accepts(required, ping) and accepts(required, call + "\n" + ping)
    single = build_constraint(None, TOOLS, "required", "hermes", parallel_tool_calls=False)
    assert accepts(single, ping) and not accepts(single, call + "\n" + ping)


def test_qwen3_coder_forced_call():
    spec = build_constraint(None, TOOLS, "required", "qwen3_coder")
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan </parameter> Jose\n</parameter>\n"
            "<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>")
    assert accepts(spec, call)
    assert not accepts(spec, call.replace("4", '"four"'))
    assert not accepts(spec, call.replace("<parameter=city>\nSan </parameter> Jose\n</parameter>\n", ""))
    free = "<tool_call>\n<function=ping>\n<parameter=host>\nx\n</parameter>\n</function>\n</tool_call>"
    assert accepts(spec, free)


def test_llama3_json_forced_call():
    spec = build_constraint(None, TOOLS, "get_weather", "llama3_json")
    assert accepts(spec, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not accepts(spec, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')


def test_auto_calls_are_lazy():
    spec = build_constraint(None, TOOLS, "auto", "hermes")
    assert spec.kind == "tool_call_lazy"
    assert accepts(spec, "No call needed, { free text }")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert accepts(spec, "<think>let me see</think>\n\n" + call + "\nand text after")
    assert not accepts(spec, "text <tool_call>\n{\"name\": \"nope\"")


def test_reasoning_prefix():
    spec = build_constraint(None, TOOLS, "ping", "hermes", reasoning="optional")
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert accepts(spec, ping) and accepts(spec, "<think>\nwhy <tool_call> here\n</think>\n\n" + ping)
    opened = build_constraint({"type": "json_object"}, reasoning="open")
    assert accepts(opened, 'thinking...</think>\n{"a": 1}') and not accepts(opened, '{"a": 1}')


def test_json_or_call_with_auto_tools():
    spec = build_constraint({"type": "json_object"}, TOOLS, "auto", "hermes")
    assert accepts(spec, '{"a": 1}')
    assert accepts(spec, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert not accepts(spec, "plain text")


def test_echo_generation_follows_the_grammar():
    text, finish = generate('{"city": "Paris"} and some trailing words', build_constraint(SCHEMA_FORMAT))
    assert text == '{"city": "Paris"}' and finish == "stop"
    text, finish = generate("not json at all", build_constraint({"type": "json_object"}))
    assert isinstance(json.loads(text), dict) and finish == "stop"
    text, _ = generate("Paris", build_constraint(SCHEMA_FORMAT))
    jsonschema.validate(json.loads(text), WEATHER)


def test_echo_named_call_is_forced():
    spec = build_constraint(None, TOOLS, "get_weather", "hermes")
    text, finish = generate('{"city": "Lima"}', spec)
    assert finish == "stop"
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    body = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    jsonschema.validate(body["arguments"], WEATHER)
