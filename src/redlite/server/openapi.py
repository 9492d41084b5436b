"""``/openapi.json``: every route's request body and exactly the responses the server gives.

The completion routes parse their bodies themselves (400 with ``param``, never FastAPI's 422),
so their bodies are declared here from the same pydantic models, with the fields of
:data:`redlite.server.schemas.UNSUPPORTED_FIELDS` narrowed to the values accepted today and the
token ids of ``prompt`` bounded by the vocabulary. Responses list the statuses each route can
answer with under the server's options (401 only with API keys, 403 only with the Host check,
the slot API's statuses only when it is enabled).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from redlite.core.sessions import SESSION_NAME
from redlite.server.schemas import (UNSUPPORTED_FIELDS, ChatCompletionRequest,
                                    CompletionRequest, SlotRequest, unsupported_json_schema)
from redlite.server.sampling_fields import MAX_TOP_LOGPROBS
from redlite.server.slots import MAX_FILENAME
from redlite.server.wire_openapi import wire_paths, wire_routes

REF = "#/components/schemas/{model}"

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
                   "request_id": {"type": "string"}}}}}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": {"type": "integer"},
                         "completion_tokens": {"type": "integer"},
                         "total_tokens": {"type": "integer"}}}

_CHAT_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                    "properties": {"id": {"type": "string"},
                                   "object": {"const": "chat.completion"},
                                   "created": {"type": "integer"}, "model": {"type": "string"},
                                   "choices": {"type": "array", "items": {
                                       "type": "object", "required": ["index", "finish_reason"]}},
                                   "usage": _USAGE}}

_TEXT_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                    "properties": {"id": {"type": "string"},
                                   "object": {"const": "text_completion"},
                                   "created": {"type": "integer"}, "model": {"type": "string"},
                                   "choices": {"type": "array", "items": {
                                       "type": "object", "required": ["index", "text"]}},
                                   "usage": _USAGE}}

_MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
          "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                         "created": {"type": "integer"}, "owned_by": {"type": "string"},
                         "max_model_len": {"type": "integer"}}}

_HEALTH = {"type": "object", "required": ["status", "queue_depth", "busy"],
           "properties": {"status": {"const": "ok"}, "queue_depth": {"type": "integer"},
                          "busy": {"type": "boolean"}}}

_DESCRIPTIONS = {200: "OK", 400: "invalid request (the error names `param`)",
                 401: "missing or wrong API key", 403: "Host not allowed",
                 404: "not found", 408: "request body not received in time",
                 409: "the slot's state is not consistent", 413: "request body too large",
                 415: "request body is not JSON", 500: "the generation failed",
                 501: "the slot API is disabled", 503: "server busy or shutting down"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _error(status: int, model: str = "Error") -> dict:
    return {"description": _DESCRIPTIONS[status], "content": _json({"$ref": REF.format(
        model=model)})}


def _body_schema(model, components: dict) -> dict:
    """``model``'s JSON schema with its definitions moved to ``components``; unsupported fields
    narrowed to their accepted values."""
    schema = model.model_json_schema(ref_template=REF, mode="validation")
    components.update(schema.pop("$defs", {}))
    properties = schema.setdefault("properties", {})
    for name in UNSUPPORTED_FIELDS:
        properties[name] = unsupported_json_schema(name)
    return schema


def _prompt_schema(vocab_size: int) -> dict:
    return {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                   "maximum": vocab_size - 1}},
        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string",
                                                                   "minLength": 1}}]}


def _max_int_pattern(n: int) -> str:
    """A regex matching the decimal integers 0..n (no leading zeros, no sign), ``n >= 0``."""
    digits = str(n)
    options = ["0"] if len(digits) > 1 else []
    if len(digits) > 2:
        options.append(f"[1-9][0-9]{{0,{len(digits) - 2}}}")
    elif len(digits) == 2:
        options.append("[1-9]")
    # exactly len(digits) digits, at most n: equal to n up to position i, smaller at i
    for i, d in enumerate(digits):
        low = "1" if i == 0 and len(digits) > 1 else "0"
        if int(d) > int(low):
            rest = len(digits) - i - 1
            options.append(digits[:i] + f"[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    options.append(digits)
    return "^(" + "|".join(options) + ")$"


def _logit_bias_schema(vocab_size: int) -> dict:
    return {"anyOf": [{"type": "null"}, {
        "type": "object", "propertyNames": {"pattern": _max_int_pattern(vocab_size - 1)},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}]}


def _filename_schema() -> dict:
    # the rules of redlite.server.slots.validate_filename
    return {"type": "string", "minLength": 1, "maxLength": MAX_FILENAME,
            "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$",
            "not": {"anyOf": [{"pattern": "\\.\\."}, {"pattern": SESSION_NAME.pattern}]}}


def build_openapi(app: FastAPI, state: Any) -> dict:
    """The OpenAPI document of ``app`` for the server ``state`` (see module docstring)."""
    document = get_openapi(title="redlite", version="1", routes=app.routes,
                           description="OpenAI-compatible LLM server")
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["Error"] = _ERROR
    chat = _body_schema(ChatCompletionRequest, components)
    # "required" and {"type": "function", ...} are valid only with matching `tools` (a rule
    # across fields JSON Schema cannot state): the document lists the choices any body may use
    chat["properties"]["tool_choice"] = {"enum": ["none", "auto", None]}
    completion = _body_schema(CompletionRequest, components)
    completion["properties"]["prompt"] = _prompt_schema(state.tokenizer.vocab_size)
    for body in (chat, completion):
        body["properties"]["logit_bias"] = _logit_bias_schema(state.tokenizer.vocab_size)
    # the rules of redlite.server.sampling_fields.logprobs_of
    chat["properties"]["logprobs"] = {"type": ["boolean", "null"]}
    chat.setdefault("allOf", []).append({"anyOf": [
        {"not": {"required": ["top_logprobs"]}}, {"properties": {"top_logprobs": {"type": "null"}}},
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]})
    completion["properties"]["logprobs"] = {"anyOf": [
        {"type": "null"}, {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}]}
    completion["properties"]["top_logprobs"] = {"type": "null"}
    slot = SlotRequest.model_json_schema(ref_template=REF)
    slot["properties"]["filename"] = _filename_schema()
    security = getattr(state, "security", None)
    common = [401] if security is not None and security.api_keys else []
    common += [403] if security is not None and security.check_host else []
    post = [400, *common, 408, 413, 415]
    generation = [*post, 500, 503]
    slots_enabled = getattr(state, "slots", None) is not None
    routes = {
        ("/health", "get"): (None, {200: _json(_HEALTH)}, [403] if 403 in common else []),
        ("/health", "head"): (None, {200: {}}, [403] if 403 in common else []),
        ("/v1/models", "get"): (None, {200: _json({"type": "object", "required": ["data"],
                                                    "properties": {"object": {"const": "list"},
                                                                   "data": {"type": "array",
                                                                            "items": _MODEL}}})},
                                common),
        ("/v1/models/{model_id}", "get"): (None, {200: _json(_MODEL)}, common),
        ("/v1/chat/completions", "post"): (chat, {200: {**_json(_CHAT_COMPLETION),
                                                        "text/event-stream": {}}}, generation),
        ("/v1/completions", "post"): (completion, {200: {**_json(_TEXT_COMPLETION),
                                                         "text/event-stream": {}}}, generation),
        ("/slots/{id_slot}", "post"): (slot, {200: _json({"type": "object",
                                                          "required": ["id_slot"]})},
                                       [*post, 404, 409, 500, 503] if slots_enabled
                                       else [*post, 501]),
    }
    routes.update(wire_routes(components, post, generation, common))
    paths = document.setdefault("paths", {})
    for path, operations in wire_paths().items():
        paths.setdefault(path, {}).update(operations)
    if "/v1/models/{model_id}" not in paths:
        for path in list(paths):
            if path.startswith("/v1/models/{model_id"):
                paths["/v1/models/{model_id}"] = paths.pop(path)
    for (path, method), (body, ok, errors, *error_model) in routes.items():
        operation = paths.get(path, {}).get(method)
        if operation is None:
            continue
        if body is not None:
            operation["requestBody"] = {"required": True, "content": _json(body)}
        responses = {str(status): {"description": "OK", "content": content} if content
                     else {"description": "OK"} for status, content in ok.items()}
        responses.update({str(status): _error(status, *error_model) for status in sorted(set(errors))})
        operation["responses"] = responses
    slot_operation = paths.get("/slots/{id_slot}", {}).get("post")
    if slot_operation is not None:
        slot_operation["parameters"] = [
            {"name": "id_slot", "in": "path", "required": True,
             "schema": {"type": "string", "enum": ["0"]}},
            {"name": "action", "in": "query", "required": True,
             "schema": {"type": "string", "enum": ["save", "restore", "erase"]}}]
    return document


def install_openapi(app: FastAPI, state: Any) -> None:
    """Serve :func:`build_openapi`'s document at ``/openapi.json`` (built once, on first use)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, state)
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]
