"""Acceptance 3 of issue 13: ``response_format`` json_schema and a named ``tool_choice`` give
schema-valid output on the bundled SmolLM2 model, for 20 different schemas (greedy, small
max_tokens; schemas bound their strings and arrays, and objects whose extra keys a small model
would go on inventing forbid them, so every answer fits). Validated with ``jsonschema``."""

import json

import jsonschema
import pytest

from redlite.core.constraints import build_constraint
from redlite.core.chat import OutputEvent
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult
from redlite.engine.base import SamplingParams

pytestmark = pytest.mark.model

S = {"type": "string", "maxLength": 16}
SCHEMAS = [
    ("person", {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False}),
    ("color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("flag", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    ("tags", {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
              "required": ["tags"]}),
    ("point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                                "y": {"type": "integer", "minimum": -99, "maximum": 99}},
               "required": ["x", "y"], "additionalProperties": False}),
    ("city", {"type": "object", "properties": {"city": S, "country": S}, "required": ["city", "country"]}),
    ("nested", {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                                                          "required": ["id"]}}, "required": ["user"]}),
    ("choice", {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
                "required": ["answer", "sure"]}),
    ("nullable", {"type": "object", "properties": {"note": {"anyOf": [S, {"type": "null"}]}}, "required": ["note"]}),
    ("const", {"type": "object", "properties": {"kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1, "maximum": 31}},
               "required": ["kind", "day"]}),
    ("weather", {"type": "object", "properties": {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
                 "required": ["city", "unit"], "additionalProperties": False}),
    ("read_file", {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"]}),
    ("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"]}),
    ("search", {"type": "object", "properties": {"query": S, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["query"]}),
    ("set_light", {"type": "object", "properties": {"on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall"]}},
                   "required": ["on", "room"]}),
    ("send_email", {"type": "object", "properties": {"to": S, "subject": S}, "required": ["to", "subject"],
                    "additionalProperties": False}),
    ("move", {"type": "object", "properties": {"steps": {"type": "array", "items": {"enum": ["up", "down", "left", "right"]},
                                                         "minItems": 1, "maxItems": 4}}, "required": ["steps"]}),
    ("rate", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                               "comment": {"anyOf": [S, {"type": "null"}]}}, "required": ["stars", "comment"],
              "additionalProperties": False}),
    ("timer", {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 60},
                                                "label": S}, "required": ["minutes"], "additionalProperties": False}),
    ("no_args", {"type": "object", "properties": {}, "additionalProperties": False}),
]
assert len({json.dumps(s, sort_keys=True) for _, s in SCHEMAS}) == 20


@pytest.fixture(scope="module")
def generator():
    from redlite.engine.factory import load_engine

    engine, tokenizer = load_engine(None, ctx_size=1024)
    return Generator(engine, tokenizer)


def run(generator, messages, spec, max_tokens=56):
    prompt = generator.tokenizer.render_chat(messages).token_ids
    request = GenerationRequest(prompt, max_tokens, SamplingParams(temperature=0, constraint=spec))
    items = list(generator.run(request))
    result = items[-1]
    assert isinstance(result, GenerationResult)
    return "".join(i.value for i in items if isinstance(i, OutputEvent)), result.finish_reason


@pytest.mark.parametrize("name, schema", SCHEMAS[:10], ids=[n for n, _ in SCHEMAS[:10]])
def test_response_format_json_schema(generator, name, schema):
    spec = build_constraint({"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    messages = [{"role": "system", "content": "Answer in JSON."},
                {"role": "user", "content": f"Give me an example {name} object."}]
    text, finish = run(generator, messages, spec)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name, schema", SCHEMAS[10:], ids=[n for n, _ in SCHEMAS[10:]])
def test_named_tool_choice(generator, name, schema):
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    spec = build_constraint(None, tools, name, "hermes")
    messages = [{"role": "system", "content": "You call tools."},
                {"role": "user", "content": f"Please use {name} for me."}]
    text, finish = run(generator, messages, spec)
    assert finish == "stop", text
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == name
    jsonschema.validate(call["arguments"], schema)
