"""llama.cpp's tokenizer routes (issue 21): ``POST /tokenize``, ``POST /detokenize``,
``POST /apply-template``, with llama.cpp's field names and answer shapes.

- ``/tokenize``: ``{"content": str, "add_special": false, "parse_special": true,
  "with_pieces": false}`` -> ``{"tokens": [id, ...]}``, or with ``with_pieces``
  ``{"tokens": [{"id": id, "piece": str | [byte, ...]}, ...]}`` (a piece that is not valid
  UTF-8 on its own is given as its bytes, where the tokenizer can say them:
  ``token_bytes(id)``; otherwise as its decoded text). The served tokenizer parses special
  tokens in raw text (as ``/v1/completions`` does), so ``parse_special: false`` is a 400 naming
  it. ``add_special`` adds BOS when the model's tokenizer config asks for it (without it, a
  BOS at the start is left out, even one written in the text).
- ``/detokenize``: ``{"tokens": [id, ...]}`` -> ``{"content": str}`` (special tokens skipped;
  ids outside the vocabulary are a 400 naming ``tokens``).
- ``/apply-template``: a chat-completions body -> ``{"prompt": str}``, the text the chat route
  would feed the model (template, tools, forced tool-call opening), nothing generated.

Bad input is a 400 in the OpenAI error shape naming ``param``; other fields are ignored, as
llama.cpp does. Tokenizing runs in a worker thread (the tokenizers are thread-safe). The
routes' bodies and answers are added to ``/openapi.json`` here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from redlite.server.errors import APIError
from redlite.server.schemas import JSONInt


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``."""

    model_config = ConfigDict(extra="allow", strict=True)
    content: StrictStr
    add_special: StrictBool = False
    parse_special: StrictBool = True
    with_pieces: StrictBool = False


class DetokenizeRequest(BaseModel):
    """Body of ``POST /detokenize``."""

    model_config = ConfigDict(extra="allow", strict=True)
    tokens: list[JSONInt]


def piece_of(tokenizer: Any, token_id: int) -> str | list[int]:
    """The text of one token, or its bytes when they are not valid UTF-8 alone."""
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is None:
        return tokenizer.decode([token_id])
    raw = token_bytes(token_id)
    if raw is None:  # a special token: its text
        return tokenizer.decode_rendered([token_id]) if hasattr(tokenizer, "decode_rendered") \
            else tokenizer.decode([token_id])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize(tokenizer: Any, body: TokenizeRequest) -> dict:
    """The ``/tokenize`` answer for ``body`` (blocking)."""
    if not body.parse_special:
        raise APIError(400, "parse_special false is not supported by this server: special "
                       "tokens in the text are always parsed", "parse_special", "unsupported_field")
    ids = tokenizer.encode(body.content)
    bos = getattr(tokenizer, "bos_token_id", None)
    if not body.add_special and getattr(tokenizer, "add_bos", False) and ids[:1] == [bos]:
        ids = ids[1:]  # the BOS the model's config adds (a BOS written first in the text too)
    if body.with_pieces:
        return {"tokens": [{"id": i, "piece": piece_of(tokenizer, i)} for i in ids]}
    return {"tokens": ids}


def detokenize(tokenizer: Any, body: DetokenizeRequest) -> dict:
    """The ``/detokenize`` answer for ``body`` (blocking)."""
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
    return {"content": tokenizer.decode(body.tokens)}


def mount_tokenize_routes(app: FastAPI, state: Any) -> None:
    """Add the three routes to ``app`` (``state``: the app's ServerState) and their
    documentation."""
    from redlite.server.app import _parse  # the one body parser (400 naming param)
    from redlite.server import sampling_fields
    from redlite.server.openai_chat import chat_request_of
    from redlite.server.schemas import ChatCompletionRequest

    def in_thread(fn, *args):
        return asyncio.to_thread(fn, state.tokenizer, *args)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Any:
        return await in_thread(tokenize, await _parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Any:
        return await in_thread(detokenize, await _parse(request, DetokenizeRequest))

    @app.post("/apply-template")
    async def apply_template_route(request: Request) -> Any:
        body = await _parse(request, ChatCompletionRequest)
        # the same validation as the chat route: a body it refuses is refused here too
        sampling = sampling_fields.sampling_of(body, state.tokenizer.vocab_size, chat=True)
        chat = chat_request_of(body, sampling, [], "apply-template")
        prepared = await state.chat.prepare(chat)
        return {"prompt": prepared.prompt_text}

    _document(app, state)


def _document(app: FastAPI, state: Any) -> None:
    """Add the routes' bodies and answers to the app's OpenAPI document when it is built."""
    from redlite.server.openapi import REF, _body_schema, _error
    from redlite.server.schemas import ChatCompletionRequest

    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        components = document["components"]["schemas"]
        vocab = state.tokenizer.vocab_size
        token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
        tokenize_body = TokenizeRequest.model_json_schema(ref_template=REF)
        tokenize_body["properties"]["parse_special"] = {"const": True}
        pieces = {"type": "array", "items": {"anyOf": [
            {"type": "integer"}, {"type": "object", "required": ["id", "piece"], "properties": {
                "id": {"type": "integer"}, "piece": {"anyOf": [
                    {"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}}}]}}
        detokenize_body = DetokenizeRequest.model_json_schema(ref_template=REF)
        detokenize_body["properties"]["tokens"] = token_ids
        chat = document["paths"].get("/v1/chat/completions", {}).get("post", {})
        chat_body = chat.get("requestBody") or {"required": True, "content": {
            "application/json": {"schema": _body_schema(ChatCompletionRequest, components)}}}
        chat_errors = [s for s in chat.get("responses", {}) if s not in ("200", "500", "503")]
        errors = chat_errors or ["400", "408", "413", "415"]
        routes = {"/tokenize": ({"required": True, "content": {"application/json": {
                      "schema": tokenize_body}}}, {"type": "object", "required": ["tokens"],
                                                   "properties": {"tokens": pieces}}),
                  "/detokenize": ({"required": True, "content": {"application/json": {
                      "schema": detokenize_body}}}, {"type": "object", "required": ["content"],
                                                     "properties": {"content": {"type": "string"}}}),
                  "/apply-template": (chat_body, {"type": "object", "required": ["prompt"],
                                                  "properties": {"prompt": {"type": "string"}}})}
        for path, (body, answer) in routes.items():
            operation = document["paths"].get(path, {}).get("post")
            if operation is None:
                continue
            operation["requestBody"] = body
            operation["responses"] = {"200": {"description": "OK", "content": {
                "application/json": {"schema": answer}}}, **{s: _error(int(s)) for s in errors}}
        return document

    app.openapi = openapi  # type: ignore[method-assign]
