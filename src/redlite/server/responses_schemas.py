"""Request body of the OpenAI Responses API (``POST /v1/responses``), validated by pydantic.

Field meanings follow OpenAI's Responses API reference. Models are strict (no string-to-number
coercion) and accept unknown fields (``truncation``, ``user``, ``service_tier``,
``safety_identifier``, ``client_metadata``, ``top_logprobs`` ... are ignored). Input items are
typed by ``type`` (a message may omit it); item types the converter does not use
(``custom_tool_call``, ``local_shell_call``, ``web_search_call`` ...) are accepted and skipped,
and so are tools of types other than ``function``. Image, file and audio parts and
``item_reference`` items are refused (``unsupported_content``), and so are the fields of
:data:`UNSUPPORTED_RESPONSES_FIELDS` and ``include`` values outside :data:`INCLUDABLE`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator,
                      model_validator)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from redlite.server.reasoning_token import PREFIX as REASONING_PREFIX, decode_reasoning
from redlite.server.schemas import Unsupported, int_in

_STRICT = ConfigDict(extra="allow", strict=True)
KNOWN_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class TextPart(BaseModel):
    """``input_text`` / ``output_text`` / ``text`` / ``summary_text`` / ``reasoning_text``."""

    model_config = _STRICT
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: StrictStr


class RefusalPart(BaseModel):
    model_config = _STRICT
    type: Literal["refusal"]
    refusal: StrictStr


class MediaPart(BaseModel):
    """``input_image`` / ``input_file`` / ``input_audio``: refused (text-only models)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _refuse(self):
        raise PydanticCustomError("unsupported_content", f"{self.type} is not supported: redlite "
                                  "serves text-only models")


Parts = list[TextPart | RefusalPart | SkipJsonSchema[MediaPart]]


class MessageItem(BaseModel):
    """A message; ``type`` may be omitted (the "easy" input message)."""

    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | Parts


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | Parts


class ReasoningItem(BaseModel):
    """A replayed reasoning item: its text comes from our ``encrypted_content``, else its
    ``reasoning_text`` content, else its summary. An ``encrypted_content`` in redlite's format
    (:mod:`redlite.server.reasoning_token`) that does not decode is refused (a damaged token
    would silently drop the reasoning); any other value is another server's, which redlite
    cannot read: the converter ignores it (logged)."""

    model_config = _STRICT
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None
    encrypted_content: StrictStr | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _intact(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(REASONING_PREFIX) and decode_reasoning(value) is None:
            raise PydanticCustomError("reasoning_token", "not a reasoning token this server gave (it "
                                      "starts as one but does not decode): send the item back as "
                                      "the response gave it, or without encrypted_content")
        return value


class OtherItem(BaseModel):
    """An item of a type the converter skips (``item_reference``, ``local_shell_call`` ...)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "properties": {"type": {"type": "string", "not": {"enum": list(KNOWN_ITEMS)}}}})
    type: StrictStr

    @model_validator(mode="after")
    def _unknown_only(self):
        if self.type in KNOWN_ITEMS:
            raise PydanticCustomError("item_type", "not a valid {type} item", {"type": self.type})
        if self.type == "item_reference":  # skipping it would silently drop a piece of the input
            raise PydanticCustomError("unsupported_content", "item_reference is not supported: send "
                                      "the item itself, or continue with previous_response_id")
        return self


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | OtherItem


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: Annotated[StrictStr, Field(min_length=1)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class OtherTool(BaseModel):
    """A tool of another type (``web_search``, ``local_shell``, ``custom``, ``namespace``,
    ``file_search`` ...): skipped with a log line."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "properties": {"type": {"type": "string", "not": {"const": "function"}}}})
    type: StrictStr

    @model_validator(mode="after")
    def _not_function(self):
        if self.type == "function":
            raise PydanticCustomError("tool_type", "not a valid function tool")
        return self


class FunctionChoice(BaseModel):
    """``{"type": "function", "name"}``: that function must be called."""

    model_config = _STRICT
    type: Literal["function"]
    name: StrictStr


class AllowedToolsChoice(BaseModel):
    """``{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function",
    "name"}, ...]}``: only these tools may be called (entries of other types are skipped)."""

    model_config = _STRICT
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class ReasoningOptions(BaseModel):
    """``reasoning``: ``effort`` (``none`` turns the template's thinking off), ``summary``."""

    model_config = _STRICT
    effort: StrictStr | None = None
    summary: StrictStr | None = None


class TextOptions(BaseModel):
    """``text``: ``format`` is ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "strict"}``; ``verbosity`` is accepted."""

    model_config = _STRICT
    format: dict[str, Any] | None = None


INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content",
              "message.output_text.logprobs")
"""The values ``include`` takes (the API's ``ResponseIncludable``); any other is a 400 naming
it. Only ``reasoning.encrypted_content`` changes the output (see
:mod:`redlite.server.reasoning_token`); the others are accepted with no effect: they name items
redlite never makes (tool results, images) or, ``message.output_text.logprobs``, the
``logprobs`` lists that stay empty."""

Includable = Literal[INCLUDABLE]


UNSUPPORTED_RESPONSES_FIELDS: dict[str, Unsupported] = {
    "conversation": Unsupported((None,), "conversation (the Conversations API; continue with "
                                         "previous_response_id or send the whole input)"),
    "prompt": Unsupported((None,), "prompt (stored prompt templates)"),
}
"""Responses fields not implemented: ignoring them would answer another conversation or prompt
than the client meant, so a request setting one is refused (400 ``unsupported_field``)."""


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``."""

    model_config = _STRICT
    unsupported_fields: ClassVar[dict[str, Unsupported]] = UNSUPPORTED_RESPONSES_FIELDS
    model: StrictStr | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    tools: list[FunctionTool | OtherTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int_in(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    include: list[Includable] | None = None
    stream: StrictBool = False
    prompt_cache_key: StrictStr | None = None
    metadata: dict[str, Any] | None = None
