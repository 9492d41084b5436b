"""What a request's output must look like, as a grammar: a pure builder (torch-free, no I/O).

:func:`build_constraint` turns the request fields that constrain the output (``response_format``,
``tools`` + ``tool_choice`` + the model's tool-call format) into a :class:`ConstraintSpec`: a
grammar in llguidance's Lark dialect (``%json {schema}`` embeds a JSON schema; a rule marked
``[lazy]`` ends at the first match of what follows it). :mod:`redlite.core.grammar` compiles it
and the engine's sampler applies it as a logits mask, token by token.

The rules, in order:

* ``tool_choice`` ``"required"`` or a named function (``{"type": "function", "function":
  {"name"}}`` arrives as the name): the whole answer is a call in the model's format,
  arguments following the tool's ``parameters`` schema; ``response_format`` does not apply
  (the answer is a call). A named function is called once (as vLLM forces it); ``required``
  allows several calls in a row when ``parallel_tool_calls``, at most
  :data:`MAX_FORCED_CALLS` (one when not). After each complete call the turn may end (the
  end-of-turn token is allowed; with several calls also after one trailing ``\n``), so
  "required" means at least one call, not a call after a call until ``max_tokens``.
* ``response_format`` ``json_object`` / ``json_schema`` (``strict`` or not: the output is
  always constrained, as vLLM does): the answer is that JSON value; with ``tools`` and
  ``tool_choice: "auto"`` a call is allowed instead.
* ``tool_choice: "auto"`` with tools and a format that opens calls with a tag (``hermes``,
  ``qwen3_coder``): a *lazy* grammar: text is free until the model writes ``<tool_call>``; from
  there the call must be complete and its arguments schema-valid, then text is free again.
  ``llama3_json`` has no opening tag, so ``auto`` leaves it unconstrained.
* ``reasoning``: ``"optional"`` lets a forced answer start with a ``<think>...</think>`` block,
  ``"open"`` says the prompt already opened ``<think>`` so the output first closes it.

Call formats (names shared with the tool-call parsers):

* ``hermes``: ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``, calls
  separated by ``\\n``.
* ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n`` then per parameter
  ``<parameter=KEY>\\nVALUE\\n</parameter>\\n`` then ``</function>\\n</tool_call>``. Parameters
  come in the schema's ``properties`` order, required ones always, optional ones may be left
  out; a string value is any text up to ``\\n</parameter>`` (an ``enum`` of strings: one of
  them), any other type is JSON of its sub-schema. A schema without ``properties`` allows any
  parameter names with text values.
* ``llama3_json``: ``{"name": "NAME", "parameters": ARGS}`` (one call).

JSON is written compactly with ``", "`` and ``": "`` separators (no free whitespace: a small
model cannot pad forever), set through llguidance's ``x-guidance`` schema options. Objects are
closed as xgrammar's ``strict_mode`` closes them (:mod:`redlite.core.closed_objects`: an object
schema that lists ``properties`` and says nothing about other keys allows no other keys, so
the model cannot add keys until ``max_tokens``); a tool without ``parameters`` takes none (an
empty object, as OpenAI defines it); ``json_object`` stays any object. Tool schemas
and non-strict ``json_schema`` formats are compiled leniently (keywords llguidance does not
implement are ignored, as agents' tool schemas carry many); a strict ``json_schema`` with such a
keyword is an error.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Literal

from redlite.core.closed_objects import close_objects

TOOL_FORMATS = ("hermes", "qwen3_coder", "llama3_json")
#: the most calls a constrained answer (``tool_choice: "required"``, or ``auto`` with a
#: ``response_format``) may hold with parallel calls
MAX_FORCED_CALLS = 8
#: the parameters of a tool that gives none: no arguments
NO_PARAMETERS = {"type": "object", "properties": {}}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TEXT = "TEXT: /(.|\\n)*/"


class ConstraintError(ValueError):
    """A request field that cannot be turned into a grammar; ``param`` names it (for a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ConstraintSpec:
    """A grammar the generated text must follow.

    grammar: llguidance Lark text (start rule ``start``). kind: ``json`` (response_format),
    ``tool_call`` (a forced call), ``json_or_tool_call``, ``tool_call_lazy`` (auto: free text
    until ``<tool_call>``). description: one line for logs.
    """

    grammar: str
    kind: str
    description: str


def build_constraint(response_format: dict | None, tools: list[dict] | None = None,
                     tool_choice: str | None = "auto", tool_format: str | None = None, *,
                     parallel_tool_calls: bool = True,
                     reasoning: Literal["none", "optional", "open"] = "none") -> ConstraintSpec | None:
    """The grammar for these request fields, or None when the output is free.

    response_format: None, ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the wire shape; a flat
    ``{"type": "json_schema", "schema": ...}`` is accepted too). tools: OpenAI function tools.
    tool_choice: ``auto``, ``none``, ``required`` or a function name. tool_format: one of
    :data:`TOOL_FORMATS` (None: ``hermes`` for forced calls, nothing for ``auto``).

    Raises :class:`ConstraintError` for an unknown response_format type, a schema that is not
    a JSON object, a named function that is not among ``tools``, an unknown tool format, or
    ``required`` without tools.
    """
    functions = _functions(tools or [])
    choice = tool_choice or "auto"
    if tool_format is not None and tool_format not in TOOL_FORMATS:
        raise ConstraintError(f"unknown tool-call format {tool_format!r}", "tool_format")
    json_rule = _response_format_rule(response_format)
    forced = choice not in ("auto", "none")
    if forced:
        if choice != "required":
            functions = [f for f in functions if f["name"] == choice]
            if not functions:
                raise ConstraintError(f"tool_choice names {choice!r}, which is not among the tools",
                                      "tool_choice")
        elif not functions:
            raise ConstraintError('tool_choice "required" needs at least one tool', "tool_choice")
        parallel = parallel_tool_calls and choice == "required"
        rules, calls = _calls(functions, tool_format or "hermes", parallel)
        return _spec(rules, f"start: {_prefix(reasoning)}{calls}", "tool_call", reasoning,
                     f"forced {tool_format or 'hermes'} call of {', '.join(f['name'] for f in functions)}")
    use_tools = choice == "auto" and functions and tool_format is not None
    if json_rule is not None:
        rules = [f"json_answer: {json_rule}"]
        body = "json_answer"
        kind = "json"
        if use_tools:
            call_rules, calls = _calls(functions, tool_format, parallel_tool_calls)
            rules += call_rules
            body, kind = f"(json_answer | {calls})", "json_or_tool_call"
        return _spec(rules, f"start: {_prefix(reasoning)}{body}", kind, reasoning,
                     f"{kind}: {_describe(response_format)}")
    if use_tools and tool_format in ("hermes", "qwen3_coder"):
        rules, _ = _calls(functions, tool_format, parallel_tool_calls=False)
        # the opening tag of each call is matched lazily inside free text (the trigger)
        rules = [r.replace('call: "<tool_call>', "call: call_trigger \"", 1) if r.startswith("call:") else r
                 for r in rules]
        rules += ['call_trigger[lazy]: TEXT "<tool_call>"', _TEXT]
        return ConstraintSpec("\n".join(["start: call* TEXT"] + rules), "tool_call_lazy",
                              f"auto {tool_format} calls of {len(functions)} tools")
    return None


def _functions(tools: list[dict]) -> list[dict]:
    """``[{"name", "parameters"}]`` of the function tools (parameters default to any object)."""
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        if not isinstance(parameters, dict):
            raise ConstraintError(f"tool {function['name']!r}: parameters must be a JSON schema object",
                                  "tools")
        out.append({"name": function["name"], "parameters": parameters})
    return out


def _response_format_rule(response_format: dict | None) -> str | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _json({"type": "object"}, close=False)
    if kind == "json_schema":
        holder = response_format.get("json_schema", response_format)
        schema = holder.get("schema") if isinstance(holder, dict) else None
        if schema is None:
            schema = {}
        if not isinstance(schema, dict):
            raise ConstraintError("response_format.json_schema.schema must be a JSON object",
                                  "response_format")
        return _json(schema, lenient=holder.get("strict") is not True)
    raise ConstraintError(f"response_format type {kind!r} is not supported "
                          "(text, json_object, json_schema)", "response_format")


def _json(schema: dict, lenient: bool = True, close: bool = True) -> str:
    """``%json {...}`` of ``schema`` with the compact-output options added; ``close``: its
    objects closed (:func:`redlite.core.closed_objects.close_objects`)."""
    schema = copy.deepcopy(close_objects(schema) if close else schema)
    options = dict(JSON_OPTIONS, lenient=lenient)
    if isinstance(schema.get("x-guidance"), dict):
        options.update(schema["x-guidance"])
    schema["x-guidance"] = options
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _calls(functions: list[dict], tool_format: str, parallel_tool_calls: bool) -> tuple[list[str], str]:
    """(rules, expression) for one or more calls of any of ``functions``; defines rule ``call``."""
    rules: list[str] = []
    names = []
    for i, function in enumerate(functions):
        name = f"call_{i}"
        names.append(name)
        rules += _call_rules(name, function, tool_format)
    if tool_format == "llama3_json":
        rules.insert(0, f"call: {' | '.join(names)}")
        return rules, "call"
    rules.insert(0, 'call: "<tool_call>\\n" (' + " | ".join(names) + ') "\\n</tool_call>"')
    if not parallel_tool_calls:
        return rules, "call"
    # the turn may end after any complete call, a "\n" after it included (a model that writes
    # one there is not made to open another call)
    return rules, f'call ("\\n" call){{0,{MAX_FORCED_CALLS - 1}}} "\\n"?'


def _call_rules(rule: str, function: dict, tool_format: str) -> list[str]:
    """Rules for one call of ``function`` (inside ``<tool_call>\\n ... \\n</tool_call>``)."""
    name, schema = function["name"], function["parameters"]
    if tool_format == "hermes":
        head = '{"name": ' + json.dumps(name) + ', "arguments": '
        return [f'{rule}: {_lit(head)} {_json(schema)} "}}"']
    if tool_format == "llama3_json":
        head = '{"name": ' + json.dumps(name) + ', "parameters": '
        return [f'{rule}: {_lit(head)} {_json(schema)} "}}"']
    # qwen3_coder: the last "\n" of the call is the one before </tool_call>
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else None
    rules = [f"{rule}: {_lit(f'<function={name}>')} \"\\n\" {rule}_params \"</function>\""]
    if properties is None:
        rules += [f"{rule}_params: {rule}_any*",
                  f'{rule}_any: "<parameter=" /[A-Za-z_][A-Za-z0-9_.-]*/ ">\\n" {rule}_text',
                  f'{rule}_text[lazy]: TEXT "\\n</parameter>\\n"', _TEXT]
        return rules
    required = set(schema.get("required") or [])
    parts = []
    for j, (key, sub) in enumerate(properties.items()):
        p = f"{rule}_p{j}"
        parts.append(p if key in required else f"{p}?")
        sub = sub if isinstance(sub, dict) else {}
        head = _lit(f"<parameter={key}>\n")
        if _is_string(sub):
            if isinstance(sub.get("enum"), list) and all(isinstance(v, str) for v in sub["enum"]):
                values = " | ".join(_lit(v) for v in sub["enum"])
                rules.append(f'{p}: {head} ({values}) "\\n</parameter>\\n"')
            else:
                rules += [f"{p}: {head} {p}_text", f'{p}_text[lazy]: TEXT "\\n</parameter>\\n"']
        else:
            rules.append(f'{p}: {head} {_json(sub)} "\\n</parameter>\\n"')
    rules.insert(1, f"{rule}_params: {' '.join(parts)}" if parts else f'{rule}_params: ""')
    if _TEXT not in rules:
        rules.append(_TEXT)
    return rules


def _is_string(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "string" or (kind is None and "enum" not in schema and "properties" not in schema
                                and "items" not in schema and "anyOf" not in schema)


def _prefix(reasoning: str) -> str:
    return {"none": "", "optional": "think? ", "open": "think_rest "}[reasoning]


def _spec(rules: list[str], start: str, kind: str, reasoning: str, description: str) -> ConstraintSpec:
    lines = [start] + rules
    if reasoning != "none":
        lines += ['think: "<think>" think_rest', 'think_rest: think_body /[ \\n]*/',
                  'think_body[lazy]: TEXT "</think>"']
        if _TEXT not in lines:
            lines.append(_TEXT)
    return ConstraintSpec("\n".join(_dedupe(lines)), kind, description)


def _dedupe(lines: list[str]) -> list[str]:
    seen: set[str] = set()
    return [line for line in lines if not (line in seen or seen.add(line))]


def _describe(response_format: Any) -> str:
    kind = response_format.get("type")
    holder = response_format.get("json_schema") or {}
    return f"{kind} {holder.get('name', '')}".strip()
