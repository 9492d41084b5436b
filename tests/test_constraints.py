"""Constrained decoding: the grammar builder (core/constraints.py), the llguidance matcher
(core/grammar.py) and generation through the echo engine's sampler."""

import json

import jsonschema
import pytest

from redlite.core.byte_tokenizer import END, ByteTokenizer
from redlite.core.closed_objects import close_objects
from redlite.core.constraints import MAX_FORCED_CALLS, ConstraintError, build_constraint
from redlite.core.chat import OutputEvent
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.core.grammar import GrammarMatcher, check_constraint, grammar_tokenizer
from redlite.engine.base import SamplingParams
from redlite.engine.echo import EchoEngine

tok = ByteTokenizer()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
ANY = {"type": "function", "function": {"name": "any", "parameters": {"type": "object"}}}
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
    # llguidance's reason, not our generated grammar's listing or a position in it
    assert str(info.value) == ("cannot build the output grammar: failed to compile JSON schema: "
                               "Invalid type: nonsense")


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
    free = "<tool_call>\n<function=any>\n<parameter=host>\nx\n</parameter>\n</function>\n</tool_call>"
    assert accepts(build_constraint(None, TOOLS + [ANY], "required", "qwen3_coder"), free)
    # a tool without parameters takes none (OpenAI: an empty parameter list)
    assert not accepts(spec, free.replace("=any>", "=ping>"))
    assert accepts(spec, "<tool_call>\n<function=ping>\n</function>\n</tool_call>")


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


PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def test_forced_calls_can_end_and_are_capped():
    """``required``: at least one call; the turn may end after any complete call (also after a
    trailing newline), and at most MAX_FORCED_CALLS calls follow one another."""
    required = build_constraint(None, TOOLS, "required", "hermes")
    assert accepts(required, PING) and accepts(required, PING + "\n")
    assert accepts(required, "\n".join([PING] * MAX_FORCED_CALLS))
    assert not accepts(required, "\n".join([PING] * (MAX_FORCED_CALLS + 1)))
    assert not accepts(required, "")
    single = build_constraint(None, TOOLS, "required", "hermes", parallel_tool_calls=False)
    assert accepts(single, PING) and not accepts(single, PING + "\n" + PING)
    coder = build_constraint(None, TOOLS, "required", "qwen3_coder")
    call = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    assert accepts(coder, call + "\n") and accepts(coder, "\n".join([call] * MAX_FORCED_CALLS))
    assert not accepts(coder, "\n".join([call] * (MAX_FORCED_CALLS + 1)))


def test_echo_required_calls_stop():
    """The echo engine's source holds twelve calls: the answer holds MAX_FORCED_CALLS; a call
    followed by a newline and text ends after the call (the newline no longer forces another)."""
    spec = build_constraint(None, TOOLS, "required", "hermes")
    text, finish = generate("\n".join([PING] * 12), spec, max_tokens=4000)
    assert finish == "stop" and text == "\n".join([PING] * MAX_FORCED_CALLS) + "\n"
    text, finish = generate(PING + "\nDone, nothing else to call.", spec)
    assert finish == "stop" and text == PING + "\n"


def test_objects_listing_properties_are_closed():
    """No keys beyond ``properties`` unless the schema allows them (xgrammar's strict_mode)."""
    open_weather = {k: v for k, v in WEATHER.items() if k != "additionalProperties"}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": open_weather}},
             {"type": "function", "function": {"name": "opts", "parameters": {
                 "type": "object", "properties": {"env": {"type": "object"},
                                                  "inner": {"type": "object", "properties": {"a": {"type": "integer"}}},
                                                  "extra": {"type": "object", "properties": {}, "additionalProperties": True}}}}}]

    def call(name, arguments):
        return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, arguments)

    weather = build_constraint(None, tools, "get_weather", "hermes")
    assert accepts(weather, call("get_weather", '{"city": "Paris"}'))
    assert not accepts(weather, call("get_weather", '{"city": "Paris", "x": 1}'))
    opts = build_constraint(None, tools, "opts", "hermes")
    assert accepts(opts, call("opts", '{"env": {"ANY": "thing"}}'))  # an object without properties: open
    assert accepts(opts, call("opts", '{"extra": {"k": 1}}'))  # allowed by the schema: kept
    assert accepts(opts, call("opts", '{"inner": {"a": 1}}'))
    assert not accepts(opts, call("opts", '{"inner": {"a": 1, "b": 2}}'))  # nested: closed
    assert not accepts(opts, call("opts", '{"other": 1}'))
    assert accepts(build_constraint({"type": "json_object"}), '{"any": 1}')  # json_object: any object
    loose = {"type": "json_schema", "json_schema": {"schema": open_weather}}
    assert not accepts(build_constraint(loose), '{"city": "Paris", "x": 1}')


def test_closing_keeps_intersections_satisfiable():
    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    more = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    both = close_objects({"allOf": [base, more]})
    assert both["allOf"] == [base, more]  # members of an intersection stay open
    ref = close_objects({"$defs": {"A": base}, "properties": {"x": {"$ref": "#/$defs/A"}}})
    assert ref["$defs"]["A"]["additionalProperties"] is False and ref["additionalProperties"] is False
    mixed = close_objects({"$defs": {"A": base}, "$ref": "#/$defs/A", "properties": {"b": {}}})
    assert "additionalProperties" not in mixed and mixed["$defs"]["A"] == base
    either = close_objects({"anyOf": [base, more]})
    assert all(s["additionalProperties"] is False for s in either["anyOf"])
    assert close_objects({"not": base}) == {"not": base}
    sloppy = {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}  # b: not listed
    assert close_objects(sloppy) == sloppy
    assert "additionalProperties" not in close_objects({"properties": {"a": {}}, "minProperties": 2})
    grammar = build_constraint({"type": "json_schema", "json_schema": {"schema": {"allOf": [base, more]}}})
    assert accepts(grammar, '{"a": 1, "b": 2}')


def test_echo_forced_call_with_open_schema_closes():
    """The echo source goes on with keys the schema does not list: the call still closes."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    source = '{"city": "Lima", ' + ", ".join(f'"k{i}": "v{i}"' for i in range(60)) + "}"
    text, finish = generate(source, build_constraint(None, tools, "get_weather", "hermes"), max_tokens=150)
    assert finish == "stop"
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'


def test_pipeline_json_drops_padding_and_truncation_only_where_set():
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from redlite.core.grammar import _pipeline_json
    backend = Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert _pipeline_json(backend) == backend.to_str()
    backend.enable_padding(length=8)
    backend.enable_truncation(max_length=4)
    spec = json.loads(_pipeline_json(backend))
    assert spec["padding"] is None and spec["truncation"] is None
    assert spec["model"] == json.loads(backend.to_str())["model"]
