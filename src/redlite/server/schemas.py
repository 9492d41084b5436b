"""Request bodies of the OpenAI API (chat completions, legacy completions), validated by pydantic.

Field meanings follow the OpenAI API reference; ``top_k``, ``min_p`` and ``repetition_penalty``
are the llama.cpp/vLLM extensions. ``logprobs`` is a boolean for chat (with ``top_logprobs``)
and an integer (alternatives per token) for legacy completions; see
:mod:`redlite.server.sampling_fields`. Unknown fields are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


MAX_CHOICES = 16
"""Most choices (``n``) one request may ask for (they run one after another)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token for ``top_logprobs`` / completions ``logprobs`` (as vLLM)."""


class TextPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part of a message."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message; ``content`` is a string, a list of text parts, or null (assistant)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

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
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict | None = None


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions`` (``max_tokens`` defaults to 16, as in the OpenAI API)."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
