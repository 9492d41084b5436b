"""The one internal chat request that every wire API converts into, and what a generation emits.

Each surface (OpenAI chat completions, Anthropic Messages, OpenAI Responses) is an adapter: it
validates its own body, builds a :class:`ChatRequest`, hands it to the chat service, and renders
the :class:`OutputEvent` stream back in its own wire shape. Rendering, reuse, stop sequences,
reasoning / tool-call parsing, constrained decoding and the log lines are therefore identical on
every surface (the rule llama.cpp's server follows: one internal request, many front ends).

Messages are kept in the OpenAI chat shape because that is what chat templates expect:

* ``{"role": "system" | "user", "content": str}``
* ``{"role": "assistant", "content": str | None, "reasoning_content": str (optional),
  "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}] (optional)}``
  (``arguments`` is the JSON text; the renderer converts it to what the template expects)
* ``{"role": "tool", "tool_call_id": str, "content": str, "name": str (optional)}``

torch-free.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from redlite.engine.base import SamplingParams

ToolChoice = Literal["auto", "none", "required"] | str
"""``auto``, ``none``, ``required``, or the name of the one function that must be called."""


@dataclass
class ChatRequest:
    """A chat generation request, independent of the wire API it came from.

    messages: OpenAI-shaped history (see module docstring); ``developer`` already mapped to
        ``system``; content parts already joined into strings.
    tools: OpenAI function tools, ``[{"type": "function", "function": {"name", "description",
        "parameters"}}]`` (other tool types dropped by the adapter).
    tool_choice: see :data:`ToolChoice`; a named function forces a call of that function.
    allowed_tools: the names the answer may call (None: every tool); the prompt still lists
        every tool, so the held state of a turn with all of them stays usable.
    template_kwargs: passed to the chat template (``enable_thinking``, ``preserve_thinking``...).
    max_tokens: most tokens to generate (None: the server's cap / the context).
    response_format: None, ``{"type": "json_object"}`` or ``{"type": "json_schema",
        "schema": {...}, "strict": bool}`` (constrained decoding of the content).
    logprobs: None (off) or how many top alternatives to report per token (0 = only the token).
    session_key: the client's session identity when it sent one (headers or body fields).
    continue_final: the last message is an assistant prefill (non-empty text content) that the
        answer continues (Anthropic's semantics): rendered without its end of turn, and the
        answer holds only the continuation.
    call_id_prefix: how the ids the server gives tool calls begin (``call_``; Anthropic's
        surface ``toolu_``).
    """

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    allowed_tools: list[str] | None = None
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    response_format: dict | None = None
    logprobs: int | None = None
    n: int = 1
    session_key: str | None = None
    continue_final: bool = False
    call_id_prefix: str = "call_"
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:24]}")


@dataclass
class ToolCall:
    """A complete tool call as parsed from the generated text.

    id: ``call_`` + random hex (made by the server); arguments: a JSON object as text.
    """

    id: str
    name: str
    arguments: str


def new_tool_call_id(prefix: str = "call_") -> str:
    """A fresh tool-call id: ``prefix`` + 24 hex digits (OpenAI's style ``call_``,
    Anthropic's ``toolu_``)."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class OutputEvent:
    """One piece of a generation's output, in generation order.

    kind:
      ``content``    value: str, a piece of the answer's text;
      ``reasoning``  value: str, a piece of the reasoning (``<think>`` text);
      ``tool_call``  value: :class:`ToolCallDelta`, the start of a call (index, id, name set,
                     arguments "") or a piece of its arguments (index set, id/name None).
    The pieces of each kind concatenate to exactly the non-streamed result.
    """

    kind: Literal["content", "reasoning", "tool_call"]
    value: Any


@dataclass
class ToolCallDelta:
    """A streamed piece of tool call ``index`` (0-based within the answer)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class OutputPart:
    """One block of an answer: ``content`` or ``reasoning`` text, or a ``tool_call`` (``call``:
    the very :class:`ToolCall` of ``ChatOutput.tool_calls``)."""

    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    call: ToolCall | None = None


@dataclass
class ChatOutput:
    """The whole parsed answer (non-streamed view). finish_reason: ``stop``, ``length``,
    ``tool_calls``, ``stop_sequence`` is reported as ``stop`` with ``stop_sequence`` set.
    dropped_calls: calls the scanner dropped (malformed, or cut by ``max_tokens``): their text
    was generated but is in neither ``content`` nor ``tool_calls``.
    cut_call: the call ``max_tokens`` cut after its name was streamed (one of ``dropped_calls``),
    with its arguments so far (what was streamed), else None; never a call to run.
    parts: the answer in generation order (text after a call is a part after it; adjacent text
    of one kind is one part); the content parts concatenate to ``content``, the reasoning parts
    to ``reasoning``, and the calls are ``tool_calls``. See :meth:`ordered_parts`.
    context_full: finish ``length`` came from the context being full, not from ``max_tokens``."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    dropped_calls: int = 0
    cut_call: ToolCall | None = None
    parts: list[OutputPart] = field(default_factory=list)
    context_full: bool = False

    def add_text(self, kind: str, piece: str) -> None:
        """Append a piece of ``content`` or ``reasoning`` text (to its field and its part)."""
        if kind == "content":
            self.content += piece
        else:
            self.reasoning += piece
        if self.parts and self.parts[-1].kind == kind:
            self.parts[-1].text += piece
        else:
            self.parts.append(OutputPart(kind, piece))

    def add_call(self, call: ToolCall) -> None:
        """Append a call (its arguments may still grow)."""
        self.tool_calls.append(call)
        self.parts.append(OutputPart("tool_call", call=call))

    def remove_dropped_calls(self) -> None:
        """Remove the calls whose name was cleared (dropped); the text around them joins."""
        self.tool_calls = [call for call in self.tool_calls if call.name]
        kept: list[OutputPart] = []
        for part in self.parts:
            if part.kind == "tool_call" and not part.call.name:
                continue
            if kept and part.kind != "tool_call" and kept[-1].kind == part.kind:
                kept[-1] = OutputPart(part.kind, kept[-1].text + part.text)
            else:
                kept.append(part)
        self.parts = kept

    def ordered_parts(self) -> list[OutputPart]:
        """``parts``; an output built without them reads as reasoning, content, then the calls."""
        if self.parts:
            return self.parts
        parts = [OutputPart(kind, text) for kind, text in
                 (("reasoning", self.reasoning), ("content", self.content)) if text]
        return parts + [OutputPart("tool_call", call=call) for call in self.tool_calls]
