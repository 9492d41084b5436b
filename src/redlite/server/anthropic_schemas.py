"""Request bodies of the Anthropic Messages API (``POST /v1/messages``, ``.../count_tokens``).

Field meanings follow Anthropic's Messages API reference. Models are strict (no string-to-number
coercion; integral numbers accepted as integers) and accept unknown fields (ignored, as
Anthropic-compatible servers do: ``metadata``, ``output_config.effort``, ``context_management``,
``service_tier``, ``container`` ...); ``output_config.format`` (structured outputs) is applied. ``cache_control`` on any block is accepted and has no
effect. Which blocks each role may hold is part of the types: user messages hold ``text`` and
``tool_result`` blocks, assistant messages ``text``, ``thinking``, ``redacted_thinking`` and
``tool_use`` blocks. ``image`` and ``document`` blocks are refused with a clear message (a
validation error of type ``unsupported_content`` naming the block).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from redlite.core.stop import MAX_STOP_SEQUENCES
from redlite.server.schemas import StopText, Unsupported, int_in

_STRICT = ConfigDict(extra="allow", strict=True)


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: StrictStr


class MediaBlock(BaseModel):
    """``image`` / ``document``: refused (redlite serves text-only models)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]

    @model_validator(mode="after")
    def _refuse(self):
        raise PydanticCustomError("unsupported_content", f"{self.type} content is not supported: "
                                  "redlite serves text-only models")


class ToolResultBlock(BaseModel):
    """A tool's answer; ``content`` a string or text blocks; ``is_error`` marks a failure."""

    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock | SkipJsonSchema[MediaBlock]] | None = None
    is_error: StrictBool | None = None


class ThinkingBlock(BaseModel):
    model_config = _STRICT
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = _STRICT
    type: Literal["redacted_thinking"]
    data: StrictStr


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


UserBlock = TextBlock | ToolResultBlock | SkipJsonSchema[MediaBlock]
AssistantBlock = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock


class UserMessage(BaseModel):
    model_config = _STRICT
    role: Literal["user"]
    content: StrictStr | Annotated[list[UserBlock], Field(min_length=1)]  # Anthropic's rule


class AssistantMessage(BaseModel):
    model_config = _STRICT
    role: Literal["assistant"]
    content: StrictStr | list[AssistantBlock]


class SystemMessage(BaseModel):
    """A system message inside the conversation (Claude Code's mid-conversation-system beta)."""

    model_config = _STRICT
    role: Literal["system"]
    content: StrictStr | Annotated[list[TextBlock], Field(min_length=1)]


MessageParam = Annotated[UserMessage | AssistantMessage | SystemMessage, Field(discriminator="role")]


class Tool(BaseModel):
    """A client tool (``type`` absent or ``custom``); server tools (``web_search_...``,
    ``bash_...``, ``text_editor_...``) carry another ``type`` and are skipped."""

    model_config = _STRICT
    type: StrictStr | None = None
    name: Annotated[StrictStr, Field(min_length=1)]
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    """``{"type": "auto" | "any" | "none", "disable_parallel_tool_use"?}``."""

    model_config = _STRICT
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: StrictBool | None = None


class NamedToolChoice(BaseModel):
    """``{"type": "tool", "name", "disable_parallel_tool_use"?}``: that tool must be called."""

    model_config = _STRICT
    type: Literal["tool"]
    name: StrictStr
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(BaseModel):
    """``{"type": "enabled", "budget_tokens"}``, ``{"type": "adaptive"}`` or ``{"type": "disabled"}``."""

    model_config = _STRICT
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int_in(ge=0) | None = None


class OutputFormat(BaseModel):
    """``{"type": "json_schema", "schema"}``: the answer's text is JSON following ``schema``
    (structured outputs)."""

    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``: its ``format`` constrains the answer; ``effort`` and other keys are
    accepted and ignored."""

    model_config = _STRICT
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    """Body of ``POST /v1/messages/count_tokens`` (the prompt part of a Messages request)."""

    model_config = _STRICT
    model: StrictStr | None = None
    system: StrictStr | list[TextBlock] | None = None
    messages: list[MessageParam] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Annotated[ToolChoice | NamedToolChoice, Field(discriminator="type")] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling


UNSUPPORTED_MESSAGES_FIELDS: dict[str, Unsupported] = {
    "thread": Unsupported((None,), "thread (message threads: send the whole conversation each turn)",
                          {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}),
}
"""Messages fields not implemented. ``thread`` (the message-threads beta) continues a conversation
the server would hold, sending only the new messages without ``system`` and ``tools``: ignoring
it would answer another conversation, so it is refused with the rejection on which the SDK's
threads (its tool runner's by default) go on unthreaded, sending the whole conversation."""


class MessagesRequest(CountTokensRequest):
    """Body of ``POST /v1/messages``; ``max_tokens`` is required, as in Anthropic's API."""

    unsupported_fields: ClassVar[dict[str, Unsupported]] = UNSUPPORTED_MESSAGES_FIELDS
    max_tokens: int_in(ge=1)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int_in(ge=0) | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
