"""Chat requests to prompts: message shaping for chat templates, format detection (torch-free).

Rendering always goes through the model's own chat template (``tokenizer.render_chat`` with
``tools=`` and the template kwargs); this module only shapes the OpenAI history the way
templates expect it:

* assistant ``tool_calls[].function.arguments`` (JSON text on the wire) become a mapping, as
  Qwen, Llama 3 and most templates iterate or ``tojson`` them (left as text when not JSON);
* ``reasoning`` on an assistant message is copied to ``reasoning_content`` (templates read that);
* ``content: null`` becomes ``""`` (templates concatenate it).

Templates that allow one system message raise on several (Qwen3.x do): the render is retried
with every system message merged, in order, into the first (joined by a blank line).

Formats are detected from the template source (:func:`detect_formats`), overridable by the
CLI's ``--tool-parser`` / ``--reasoning-parser``.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from redlite.core.chat import ChatRequest
from redlite.core.tokenizer import PromptTooLong

log = logging.getLogger("redlite.chat")


def template_messages(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` shaped for chat templates (see module docstring)."""
    shaped = []
    for message in messages:
        m = dict(message)
        if m.get("role") == "assistant":
            if m.get("content") is None:
                m["content"] = ""
            if m.get("reasoning") is not None and m.get("reasoning_content") is None:
                m["reasoning_content"] = m["reasoning"]
            m.pop("reasoning", None)
            if m.get("tool_calls"):
                m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
            else:
                m.pop("tool_calls", None)
        elif m.get("content") is None:
            m["content"] = ""
        shaped.append(m)
    return shaped


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    return {**call, "type": call.get("type", "function"), "function": function}


def merge_systems(messages: list[dict]) -> list[dict]:
    """Every system message merged, in order, into the first one (which keeps its place)."""
    systems = [m for m in messages if m.get("role") == "system"]
    if len(systems) < 2:
        return messages
    merged = {**systems[0], "content": "\n\n".join(str(m.get("content") or "") for m in systems)}
    out, placed = [], False
    for m in messages:
        if m.get("role") == "system":
            if not placed:
                out.append(merged)
                placed = True
            continue
        out.append(m)
    return out


def render_request(tokenizer: Any, request: ChatRequest):
    """``tokenizer.render_chat`` of the request (tools and template kwargs passed to the
    template). Raises what the template raises (after the system-merge retry)."""
    messages = template_messages(request.messages)
    kwargs = dict(request.template_kwargs)
    if request.tools:
        kwargs["tools"] = request.tools
    try:
        return tokenizer.render_chat(messages, **kwargs)
    except PromptTooLong:  # too long either way: no second render
        raise
    except Exception:
        merged = merge_systems(messages)
        if merged is messages:
            raise
        log.info("%s: the template refused %d system messages; merged them into the first",
                 request.request_id, sum(m.get("role") == "system" for m in messages))
        return tokenizer.render_chat(merged, **kwargs)


def detect_formats(template: str | None) -> tuple[str, str | None]:
    """(tool format, reasoning format or None) from a chat template's source.

    ``qwen3_coder`` when the template writes ``<function=`` and ``<parameter=`` markup,
    ``hermes`` when it writes ``<tool_call>``, ``llama3_json`` for a Llama 3 template
    (``<|python_tag|>`` or ``<|eom_id|>``/``ipython``), else ``hermes`` (the common default).
    Reasoning ``qwen3`` when the template mentions ``<think>`` or ``</think>``.
    """
    source = template or ""
    if "<function=" in source and "<parameter=" in source:
        tool = "qwen3_coder"
    elif "<tool_call>" in source:
        tool = "hermes"
    elif "<|python_tag|>" in source or ("<|eot_id|>" in source and "ipython" in source):
        tool = "llama3_json"
    else:
        tool = "hermes"
    reasoning = "qwen3" if "<think>" in source or "</think>" in source else None
    return tool, reasoning


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template's source reads the ``tools`` variable; a template that does not
    (SmolLM2's) leaves tool definitions out of the prompt. True when the source is unknown."""
    return template is None or re.search(r"\btools\b", template) is not None


def tool_schemas(tools: list[dict]) -> dict[str, dict]:
    """Tool name -> JSON schema of its parameters."""
    out = {}
    for tool in tools:
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str):
            out[function["name"]] = function.get("parameters") or {}
    return out
