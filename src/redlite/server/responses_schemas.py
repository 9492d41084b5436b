"""Request body of the OpenAI Responses API (``POST /v1/responses``), validated by pydantic.

Field meanings follow OpenAI's Responses API reference. Input items are kept loose (a ``type``
plus whatever the item carries; a message may omit ``type``): :mod:`redlite.server.
responses_convert` handles each known type and skips or rejects the others with a clear message.
``store``, ``metadata``, ``prompt_cache_key``, ``include``, ``truncation``, ``user``,
``service_tier``, ``safety_identifier`` and unknown fields are accepted.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class InputItem(BaseModel):
    """One ``input`` item: ``message`` (``role``, ``content`` string or parts),
    ``function_call`` (``call_id``, ``name``, ``arguments``), ``function_call_output``
    (``call_id``, ``output``), ``reasoning`` (``summary``, ``content``, ``encrypted_content``),
    ``item_reference`` or another type (skipped)."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


class ReasoningOptions(BaseModel):
    """``reasoning``: ``effort`` (``none`` turns the template's thinking off), ``summary``."""

    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None


class TextOptions(BaseModel):
    """``text``: ``format`` is ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "strict"}``; ``verbosity`` is accepted."""

    model_config = ConfigDict(extra="allow")
    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    stream: bool = False
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None
