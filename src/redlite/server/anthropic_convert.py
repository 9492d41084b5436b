"""Anthropic Messages body -> :class:`redlite.core.chat.ChatRequest` (pure, no I/O but logging).

Mapping (Anthropic Messages API -> the OpenAI-shaped history of :mod:`redlite.core.chat`):

* ``system`` (string or text blocks) -> one ``system`` message, blocks joined with ``"\\n\\n"``.
  A block whose text starts with ``x-anthropic-billing-header:`` is dropped (logged once per
  process): Claude Code puts a per-request nonce there, which would change the prompt at token
  ~40 on every turn and defeat state reuse.
* user ``text`` blocks -> a ``user`` message (consecutive text blocks joined with ``"\\n\\n"``);
  ``tool_result`` blocks -> ``tool`` messages (``tool_call_id`` = ``tool_use_id``; content text;
  ``is_error`` prefixes ``"Error: "``), in block order.
* assistant ``text`` -> ``content``; ``thinking`` -> ``reasoning_content`` (``redacted_thinking``
  is opaque and dropped); ``tool_use`` -> ``tool_calls`` with ``arguments`` = the input as JSON.
* a ``system`` message inside ``messages`` (Claude Code's mid-conversation-system beta) -> a
  ``user`` message ``<system-reminder>\nTEXT\n</system-reminder>`` (Claude Code's own wrapper
  for such text): chat templates accept a system message only first, and merging it into the
  system prompt would change the prompt's start, so every held state would be lost.
* ``image`` / ``document`` blocks are refused by the request model (400).
* ``tools`` -> OpenAI function tools; tools with another ``type`` (Anthropic server tools) are
  skipped with one log line per request.
* ``tool_choice``: auto -> auto, any -> required, tool -> the name, none -> none;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls=False``.
* ``thinking``: enabled -> ``enable_thinking=True``, disabled -> ``False``, adaptive/absent ->
  the template's default.
* ``output_config.format`` (else the beta's top-level ``output_format``) ``{"type":
  "json_schema", "schema"}`` -> ``response_format`` json_schema (not strict: keywords the
  grammar engine lacks are ignored); with a prefill it is a 400.
* ``cache_control`` markers are ignored everywhere: they never change a token of the prompt.
* a last ``assistant`` message of text only is a prefill: the answer continues it
  (``ChatRequest.continue_final``) and holds only the new text; its text may not end with
  whitespace (Anthropic's rule, 400); an empty one is no prefill. A user or system message
  with an empty content list is a 400 (schemas; it was dropped, so ``[{"role": "user", "content":
  []}]`` read no message); an assistant one is not (our empty answers come back as ``[]``).

Errors: :class:`redlite.server.errors.APIError` (400) naming the offending field.
"""

from __future__ import annotations

import json
import logging

from redlite.core.chat import ChatRequest
from redlite.engine.base import SamplingParams
from redlite.server.anthropic_schemas import CountTokensRequest, MessagesRequest, TextBlock
from redlite.server.errors import APIError

log = logging.getLogger("redlite.server.anthropic")

BILLING_PREFIX = "x-anthropic-billing-header:"
_logged_once: set[str] = set()


def _log_once(key: str, message: str, *args: object) -> None:
    if key not in _logged_once:
        _logged_once.add(key)
        log.info(message, *args)


def _unsupported(block, where: str) -> APIError:
    return APIError(400, f"{where}: unsupported content block type {block.type!r}", where)


def system_text(system: str | list[TextBlock] | None) -> str | None:
    """The system prompt without Claude Code's billing-header block; None when empty."""
    if system is None:
        return None
    if isinstance(system, str):
        blocks = [system]
    else:
        blocks = [block.text for block in system]
    kept = [text for text in blocks if not text.lstrip().startswith(BILLING_PREFIX)]
    if len(kept) != len(blocks):
        _log_once("billing", "anthropic: dropping the %r system block (a per-request nonce that "
                  "would defeat prompt reuse); logged once", BILLING_PREFIX)
    text = "\n\n".join(kept)
    return text or None


def _tool_result_text(block) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "\n\n".join(part.text for part in content)
    return f"Error: {text}" if block.is_error else text


def _user_messages(content: list, where: str) -> list[dict]:
    out: list[dict] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
            texts.clear()

    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_result":
            flush()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block)})
        else:
            raise _unsupported(block, at)
    flush()
    return out


def _assistant_message(content: list, where: str) -> dict:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "thinking":
            reasoning.append(block.thinking)
        elif block.type == "redacted_thinking":
            continue
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            raise _unsupported(block, at)
    message: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _prefill(body: CountTokensRequest, messages: list[dict]) -> str | None:
    """The text of a last assistant message of text only (None: there is none)."""
    if not body.messages or body.messages[-1].role != "assistant" or not messages:
        return None
    last = messages[-1]
    if last.get("role") != "assistant" or last.get("tool_calls") or last.get("reasoning_content"):
        return None
    text = str(last.get("content") or "")
    if text != text.rstrip():
        where = f"messages.{len(body.messages) - 1}.content"
        raise APIError(400, f"{where}: final assistant content cannot end with trailing whitespace", where)
    return text


def convert_messages(body: CountTokensRequest) -> list[dict]:
    """The OpenAI-shaped history of ``body`` (system first)."""
    messages: list[dict] = []
    system = system_text(body.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        where = f"messages.{i}"
        content = message.content
        if isinstance(content, str):
            content = [TextBlock(type="text", text=content)]
        if message.role == "user":
            messages.extend(_user_messages(content, where))
        elif message.role == "system":
            texts = [block.text for block in content]
            messages.append({"role": "user", "content": "<system-reminder>\n" + "\n\n".join(texts)
                             + "\n</system-reminder>"})
        else:
            messages.append(_assistant_message(content, where))
    return messages


def convert_tools(body: CountTokensRequest) -> list[dict]:
    """OpenAI function tools of ``body``; server tools skipped (one log line)."""
    tools, skipped = [], []
    for tool in body.tools or []:
        if tool.type not in (None, "custom"):
            skipped.append(f"{tool.name} ({tool.type})")
            continue
        function = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
        if tool.description:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    if skipped:
        log.info("anthropic: skipping %d tool(s) of server types: %s", len(skipped), ", ".join(skipped))
    return tools


def _tool_choice(body: CountTokensRequest) -> tuple[str, bool]:
    choice = body.tool_choice
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return choice.name, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def template_kwargs(body: CountTokensRequest) -> dict:
    """``enable_thinking`` from ``thinking`` (enabled/disabled); adaptive keeps the default."""
    if body.thinking is None or body.thinking.type == "adaptive":
        return {}
    return {"enable_thinking": body.thinking.type == "enabled"}


def _response_format(body: CountTokensRequest, prefill: str | None) -> dict | None:
    """The structured-output format; a 400 when ``output_format`` and ``output_config.format``
    differ, and with a prefill: the grammar starts where the answer does, after the prefill, so
    their concatenation would not be the JSON the schema describes."""
    fmt = (body.output_config.format if body.output_config else None) or body.output_format
    if fmt is None:
        return None
    if body.output_format is not None and body.output_format != fmt:
        raise APIError(400, "output_format and output_config.format differ (send one)", "output_format")
    if prefill:
        where = "output_config.format" if body.output_config and body.output_config.format else "output_format"
        raise APIError(400, f"{where} cannot be used with a prefilled final assistant message", where)
    return {"type": "json_schema", "schema": fmt.json_schema, "strict": False}


def to_chat_request(body: CountTokensRequest, session_key: str | None = None) -> ChatRequest:
    """The :class:`ChatRequest` of a Messages (or count_tokens) body."""
    tool_choice, parallel = _tool_choice(body)
    messages = convert_messages(body)
    prefill = _prefill(body, messages)
    response_format = _response_format(body, prefill)
    if prefill == "":
        messages = messages[:-1]
    request = ChatRequest(messages=messages, tools=convert_tools(body),
                          tool_choice=tool_choice, parallel_tool_calls=parallel,
                          template_kwargs=template_kwargs(body), session_key=session_key,
                          continue_final=bool(prefill), call_id_prefix="toolu_")
    if isinstance(body, MessagesRequest):
        request.max_tokens = body.max_tokens
        request.sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0)
        request.stop = list(body.stop_sequences or [])
        request.response_format = response_format
        request.request_id = request.request_id.replace("req-", "msg_", 1)
    return request
