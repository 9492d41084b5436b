"""Request bodies of the OpenAI API (chat completions, legacy completions), validated by pydantic.

Field meanings follow the OpenAI API reference; ``top_k``, ``min_p`` and ``repetition_penalty``
are the llama.cpp/vLLM extensions. ``logprobs`` is a boolean for chat (with ``top_logprobs``)
and an integer (alternatives per token) for legacy completions; see
:mod:`redlite.server.sampling_fields`. Types are strict, as the OpenAI API's are: ``"stream": "yes"``,
``"max_tokens": "10"`` or ``"prompt": [true]`` are 400s, never coerced (an integer is accepted
where a number is expected). Fields other OpenAI-compatible servers accept without effect
(``user``, ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``...) are accepted and ignored. Standard fields this server does not
implement are listed in :data:`UNSUPPORTED_FIELDS`: used with any value but their "off" values,
they are a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool,
                      StrictStr, StringConstraints, Tag, ValidationInfo, field_validator,
                      model_validator)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from redlite.core.stop import MAX_STOP_BYTES, MAX_STOP_SEQUENCES

_STRICT = ConfigDict(extra="allow", strict=True)


def _integral(value: Any) -> Any:
    """JSON has one number type: ``10.0`` is the integer 10 (JSON Schema says so too)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JSONInt = Annotated[int, BeforeValidator(_integral)]
"""An integer field: JSON integers and integral numbers (``10.0``); never strings or booleans
(the models are strict)."""


def int_in(ge: int | None = None, le: int | None = None) -> Any:
    """:data:`JSONInt` bounded by ``ge`` <= value <= ``le`` (bounds inside the type, so the
    JSON schema shows them as ``minimum`` / ``maximum``)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


@dataclass(frozen=True)
class Unsupported:
    """A standard field the server does not implement. off: the values that mean "feature not
    used" (JSON values; compared as JSON compares them: ``1 == 1.0``, ``false != 0``);
    what: how the 400 names the feature; details: the Anthropic error's ``details`` (what the
    client SDK reads to go on without the feature), None: none."""

    off: tuple
    what: str
    details: dict | None = None


UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    "echo": Unsupported((None, False), "echo"),
    "best_of": Unsupported((None, 1), "best_of"),
    "suffix": Unsupported((None, ""), "suffix"),
    "functions": Unsupported((None, []), "functions (function calling)"),
    "function_call": Unsupported((None, "none", "auto"), "function_call"),
}
"""The one table of standard fields not implemented yet (delete an entry when it lands)."""


def json_equal(a: Any, b: Any) -> bool:
    """Equality of decoded JSON values as JSON Schema's ``enum`` defines it: numbers by value,
    booleans only equal to booleans."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def unsupported_field(body: BaseModel) -> tuple[str, Unsupported] | None:
    """(field, its table entry) of the first field of ``body`` in its model's ``unsupported_fields``
    table (:data:`UNSUPPORTED_FIELDS` for the chat/completions bodies; none: no such field)
    set to a value other than its "off" values, or None."""
    extra = body.model_extra or {}
    for name, entry in getattr(type(body), "unsupported_fields", {}).items():
        if name in extra:
            value = extra[name]
        elif name in body.model_fields_set:
            value = getattr(body, name)
        else:
            continue
        if not any(json_equal(value, off) for off in entry.off):
            return name, entry
    return None


def unsupported_json_schema(name: str) -> dict:
    """The JSON schema of the values field ``name`` accepts today (its "off" values)."""
    return {"enum": list(UNSUPPORTED_FIELDS[name].off)}


MAX_CHOICES = 16
"""Most choices (``n``) one request may ask for (they run one after another)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token for ``top_logprobs`` / completions ``logprobs`` (as vLLM)."""


class TextPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part of a message."""

    model_config = _STRICT
    type: Literal["text"]
    text: StrictStr


class MediaPart(BaseModel):
    """An image / audio / file part: refused with ``this model does not accept images``
    (the validation error names the part, e.g. ``messages.0.content.1``)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "image", "input_image", "input_audio", "file"]

    @model_validator(mode="after")
    def _refuse(self):
        kind = "images" if "image" in self.type else "audio" if "audio" in self.type else "files"
        raise PydanticCustomError("unsupported_content", f"this model does not accept {kind}")


class FunctionCall(BaseModel):
    """``function`` of an assistant tool call: ``arguments`` is JSON text."""

    model_config = _STRICT
    name: StrictStr
    arguments: StrictStr = "{}"


class ToolCallIn(BaseModel):
    """An assistant message's ``tool_calls`` item."""

    model_config = _STRICT
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionTool(BaseModel):
    """``function`` of a tool: a name, a description and JSON-schema ``parameters``."""

    model_config = _STRICT
    name: Annotated[StrictStr, StringConstraints(min_length=1)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    """A ``tools`` item (only ``type: "function"``)."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionTool


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: StrictStr


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: that function must be called."""

    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class Message(BaseModel):
    """A chat message; ``content`` is a string, a list of text parts, or null (assistant only:
    a missing or null ``content`` of any other role is a 400 ``messages.N.content``, as OpenAI's).
    Assistant messages may carry ``tool_calls`` and ``reasoning_content`` / ``reasoning``;
    ``tool`` messages carry ``tool_call_id``."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart | SkipJsonSchema[MediaPart]] | None = Field(
        default=None, validate_default=True)
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("missing", "Field required (only assistant content may be null)")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage``."""

    model_config = _STRICT
    include_usage: StrictBool = False


StopText = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_STOP_BYTES)]
"""A stop sequence: 1 to 256 characters; :func:`redlite.core.stop.normalize_stop` then bounds
its UTF-8 size to MAX_STOP_BYTES bytes (400 ``stop``)."""

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class SamplingFields(BaseModel):
    """Fields shared by chat and legacy completions."""

    model_config = _STRICT
    unsupported_fields: ClassVar[dict[str, Unsupported]] = UNSUPPORTED_FIELDS
    model: StrictStr | None = None
    max_tokens: int_in(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int_in(ge=-1) | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int_in(ge=SEED_MIN, le=SEED_MAX) | None = None
    n: int_in(ge=1, le=MAX_CHOICES) | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    logprobs: StrictBool | JSONInt | None = None
    top_logprobs: int_in(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int_in(ge=1) | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: StrictBool | None = None
    response_format: dict[str, Any] | None = None


def _prompt_kind(value: Any) -> str:
    """Which form of ``prompt`` a value is meant as, so errors name that form's problem (the
    tags hold a "-", so error locations never take them for field names)."""
    if isinstance(value, str):
        return "as-text"
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return "as-texts"
    return "as-ids"


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions`` (``max_tokens`` defaults to 16, as in the OpenAI API).
    ``prompt``: one string or one list of token ids (a list of one string is that string)."""

    prompt: Annotated[
        Annotated[Annotated[str, StringConstraints(strict=True, min_length=1)], Tag("as-text")]
        | Annotated[Annotated[list[JSONInt], Field(min_length=1)], Tag("as-ids")]
        | Annotated[Annotated[list[Annotated[str, StringConstraints(strict=True, min_length=1)]],
                              Field(min_length=1, max_length=1)], Tag("as-texts")],
        Discriminator(_prompt_kind)]
    max_tokens: int_in(ge=1) | None = 16


class SlotRequest(BaseModel):
    """Body of ``POST /slots/{id}?action=save|restore`` (llama.cpp's slot API)."""

    model_config = ConfigDict(extra="allow")
    filename: StrictStr
