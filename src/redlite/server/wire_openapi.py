"""OpenAPI entries of the Anthropic Messages and OpenAI Responses routes (merged into the
server's document by :mod:`redlite.server.openapi`).

Bodies come from the same pydantic models the routes validate with; their definitions are put
in ``components`` under a prefix (``Anthropic.``, ``Responses.``) so names such as ``Tool`` do
not collide with the chat completion models. Like the chat body, each document lists only what
any body may use: ``tool_choice`` values that need matching ``tools`` (Anthropic ``any`` /
``tool``, Responses ``required`` / a function) and ``text.format`` json types (served, only
not fuzzed here) are left out. Errors of ``/v1/messages...`` have Anthropic's shape.
"""

from __future__ import annotations

from typing import Any

from redlite.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from redlite.server.inventory import TIERS
from redlite.server.responses_schemas import ResponsesRequest

ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    "request_id": {"type": "string"}}}

_ANTHROPIC_USAGE = {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
    "cache_read_input_tokens": {"type": "integer"},
    "cache_creation_input_tokens": {"type": "integer"}}}

MESSAGE = {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
           "properties": {"id": {"type": "string"}, "type": {"const": "message"},
                          "role": {"const": "assistant"}, "model": {"type": "string"},
                          "content": {"type": "array", "items": {
                              "type": "object", "required": ["type"]}},
                          "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
                          "stop_sequence": {"type": ["string", "null"]},
                          "usage": _ANTHROPIC_USAGE}}

COUNT = {"type": "object", "required": ["input_tokens"],
         "properties": {"input_tokens": {"type": "integer"}}}

INPUT_TOKENS = {"type": "object", "required": ["object", "input_tokens"],
                "properties": {"object": {"const": "response.input_tokens"},
                               "input_tokens": {"type": "integer"}}}

RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
            "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                           "created_at": {"type": "integer"},
                           "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
                           "model": {"type": "string"},
                           "output": {"type": "array", "items": {"type": "object", "required": ["type"]}}}}

DELETED = {"type": "object", "required": ["id", "object", "deleted"],
           "properties": {"id": {"type": "string"}, "object": {"const": "response.deleted"},
                          "deleted": {"const": True}}}

ITEM_LIST = {"type": "object", "required": ["object", "data", "first_id", "last_id", "has_more"],
             "properties": {"object": {"const": "list"},
                            "data": {"type": "array", "items": {
                                "type": "object", "required": ["id", "type"]}},
                            "first_id": {"type": ["string", "null"]},
                            "last_id": {"type": ["string", "null"]},
                            "has_more": {"type": "boolean"}}}


def _schema(model, prefix: str, components: dict) -> dict:
    template = "#/components/schemas/" + prefix + ".{model}"
    schema = model.model_json_schema(ref_template=template, mode="validation")
    for name, definition in schema.pop("$defs", {}).items():
        components[f"{prefix}.{name}"] = definition
    return schema


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def wire_routes(components: dict, post_errors: list[int], generation_errors: list[int],
                common: list[int]) -> dict[tuple[str, str], tuple]:
    """``{(path, method): (body schema or None, {status: content}, error statuses, error
    component)}`` for the routes of this module's surfaces; ``components`` receives the
    definitions (and ``AnthropicError``)."""
    components["AnthropicError"] = ANTHROPIC_ERROR
    choice = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "none"]},
        "disable_parallel_tool_use": {"type": ["boolean", "null"]}}}
    messages = _schema(MessagesRequest, "Anthropic", components)
    messages["properties"]["tool_choice"] = {"anyOf": [choice, {"type": "null"}]}
    count = _schema(CountTokensRequest, "Anthropic", components)
    count["properties"]["tool_choice"] = {"anyOf": [choice, {"type": "null"}]}
    responses = _schema(ResponsesRequest, "Responses", components)
    responses["properties"]["tool_choice"] = {"enum": ["auto", "none", None]}
    responses["properties"]["text"] = {"anyOf": [{"type": "null"}, {
        "type": "object", "properties": {"format": {"anyOf": [
            {"type": "null"},
            {"type": "object", "properties": {"type": {"const": "text"}}}]}}}]}
    stream: dict[str, Any] = {"text/event-stream": {}}
    return {
        ("/v1/messages", "post"): (messages, {200: {**_json(MESSAGE), **stream}}, generation_errors,
                                   "AnthropicError"),
        ("/v1/messages/count_tokens", "post"): (count, {200: _json(COUNT)}, post_errors,
                                                "AnthropicError"),
        ("/v1/responses", "post"): (responses, {200: {**_json(RESPONSE), **stream}},
                                    [*generation_errors, 404], "Error"),
        ("/v1/responses/input_tokens", "post"): (responses, {200: _json(INPUT_TOKENS)},
                                                 [*post_errors, 404], "Error"),
        ("/v1/responses/{response_id}", "get"): (None, {200: _json(RESPONSE)}, [*common, 404], "Error"),
        ("/v1/responses/{response_id}", "delete"): (None, {200: _json(DELETED)}, [*common, 404],
                                                     "Error"),
        ("/v1/responses/{response_id}/input_items", "get"): (None, {200: _json(ITEM_LIST)},
                                                             [*common, 400, 404], "Error"),
    }


def wire_paths() -> dict[str, dict[str, dict]]:
    """Operations of routes that FastAPI cannot document itself (one route serving GET and
    DELETE of a stored response), to add to the document's ``paths``."""
    parameter = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {"/v1/responses/{response_id}": {
        "get": {"operationId": "retrieve_response", "summary": "A stored response",
                "parameters": parameter},
        "delete": {"operationId": "delete_response", "summary": "Delete a stored response",
                   "parameters": parameter}}}


_CONVERSATION = {"type": "object", "required": ["id", "tier", "session_key", "tokens", "bytes",
                                                "checkpoints", "last_used"],
                 "properties": {"id": {"type": "string"},
                                "tier": {"enum": list(TIERS)},
                                "session_key": {"type": ["string", "null"]},
                                "tokens": {"type": "integer", "minimum": 0},
                                "bytes": {"type": "integer", "minimum": 0},
                                "checkpoints": {"type": "array", "items": {"type": "integer"}},
                                "last_used": {"type": "number"}}}


def observe_routes(common: list[int]) -> dict:
    """The operator routes' answers (:mod:`redlite.server.observe_routes`) for the ``routes``
    table of :func:`redlite.server.openapi.build_openapi` (no bodies)."""
    def as_json(schema: dict) -> dict:
        return {"application/json": {"schema": schema}}
    conversations = {"type": "object", "required": ["object", "data", "tiers"],
                     "properties": {"object": {"const": "list"},
                                    "data": {"type": "array", "items": _CONVERSATION},
                                    "tiers": {"type": "object"}}}
    slots = {"type": "array", "items": {"type": "object", "required": ["id", "n_ctx", "n_past"]}}
    data = {"type": "object", "required": ["recent", "outcomes"],
            "properties": {"recent": {"type": "array"}, "outcomes": {"type": "object"}}}
    return {("/metrics", "get"): (None, {200: {"text/plain": {"schema": {"type": "string"}}}}, common),
            ("/v1/conversations", "get"): (None, {200: as_json(conversations)}, common),
            ("/slots", "get"): (None, {200: as_json(slots)}, common),
            ("/dashboard", "get"): (None, {200: {"text/html": {"schema": {"type": "string"}}}}, common),
            ("/dashboard/data", "get"): (None, {200: as_json(data)}, common)}
