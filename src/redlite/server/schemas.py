"""Request bodies of the OpenAI API (chat completions, legacy completions), validated by pydantic.

Field meanings follow the OpenAI API reference; ``top_k`` and ``min_p`` are the llama.cpp/vLLM
extensions. Unknown fields are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TextPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part of a message."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """``function`` of an assistant tool call: ``arguments`` is JSON text."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    """An assistant message's ``tool_calls`` item."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionTool(BaseModel):
    """``function`` of a tool: a name, a description and JSON-schema ``parameters``."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """A ``tools`` item (only ``type: "function"``)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionTool


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: that function must be called."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: NamedFunction


class Message(BaseModel):
    """A chat message; ``content`` is a string, a list of text parts, or null (assistant).
    Assistant messages may carry ``tool_calls`` and ``reasoning_content`` / ``reasoning``;
    ``tool`` messages carry ``tool_call_id``."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage``."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and legacy completions."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions`` (``max_tokens`` defaults to 16, as in the OpenAI API)."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
