"""Request bodies of the Anthropic Messages API (``POST /v1/messages``, ``.../count_tokens``).

Field meanings follow Anthropic's Messages API reference. Content blocks are kept loose here
(``type`` plus whatever else the block carries): :mod:`redlite.server.anthropic_convert` turns
each known type into the internal chat shape and answers unknown or unsupported ones (images,
documents) with a 400 naming the block. ``cache_control`` on any block is accepted and has no
effect. Unknown top-level fields are accepted and ignored, as Anthropic-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Block(BaseModel):
    """One content block: ``text``, ``image``, ``document``, ``tool_use``, ``tool_result``,
    ``thinking``, ``redacted_thinking`` ... (checked by the converter)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    # thinking / redacted_thinking
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class MessageParam(BaseModel):
    """A turn of the conversation; ``content`` is a string or a list of blocks. ``system``
    messages inside the conversation are Claude Code's ``mid-conversation-system`` beta."""

    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(BaseModel):
    """A client tool (``type`` absent or ``custom``); server tools (``web_search_...``,
    ``bash_...``, ``text_editor_...``) carry another ``type`` and are skipped."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    """``{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    """``{"type": "enabled", "budget_tokens"}``, ``{"type": "adaptive"}`` or ``{"type": "disabled"}``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class CountTokensRequest(BaseModel):
    """Body of ``POST /v1/messages/count_tokens`` (the prompt part of a Messages request)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    system: str | list[Block] | None = None
    messages: list[MessageParam] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """Body of ``POST /v1/messages``; ``max_tokens`` is required, as in Anthropic's API.
    ``metadata``, ``output_config`` (effort), ``service_tier``, ``container`` are accepted and
    ignored (extra fields)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None


Block.model_rebuild()
