"""OpenAI Responses body -> :class:`redlite.core.chat.ChatRequest` (pure, no I/O but logging).

History (OpenAI-shaped, see :mod:`redlite.core.chat`), in this order:

1. ``instructions`` -> a ``system`` message (not carried over from a previous response, as in
   OpenAI's API);
2. with ``previous_response_id``: the stored conversation of that response (its input items
   and its output, as converted messages; see :mod:`redlite.server.responses_store`);
3. ``input``: a string is one ``user`` message; items are converted in order:

   * ``message`` (``type`` may be omitted): ``user`` / ``system`` / ``developer`` (as
     ``system``) / ``assistant``; content a string or parts (``input_text``, ``output_text``,
     ``text``, ``refusal``: their text; media parts are refused by the request model);
   * ``reasoning``: its text becomes the ``reasoning_content`` of the assistant message that
     follows; the text is taken from our ``encrypted_content`` (:mod:`redlite.server.
     reasoning_token`), else its ``reasoning_text`` content parts, else its summary texts; an
     ``encrypted_content`` of another server (not in our format: a damaged one of ours is
     refused by the request model) is ignored, with one log line per request;
   * ``function_call``: a ``tool_calls`` entry (``id`` = ``call_id``) of the current assistant
     message (consecutive assistant items merge into one message, as the model produced them:
     the text of a message item after a call is appended to the message's content, as one
     answer's content is the concatenation of its text pieces, wherever its calls fall);
   * ``function_call_output``: a ``tool`` message (``tool_call_id`` = ``call_id``);
   * other item types (``item_reference``, ``custom_tool_call``, ``local_shell_call``,
     ``web_search_call`` ...) are skipped with one log line per request.

Tools: ``function`` tools become OpenAI chat function tools; other types (``web_search``,
``local_shell``, ``custom``, ``namespace``, ``file_search`` ...) are skipped with one log line.
``tool_choice``: a string as is, ``{"type": "function", "name"}`` -> the name,
``{"type": "allowed_tools", "mode", "tools"}`` -> ``mode`` with ``allowed_tools`` (the names of
its function entries; every tool stays in the prompt). ``reasoning.effort == "none"`` -> ``enable_thinking=False``. ``text.format``
json_object / json_schema -> ``response_format`` (a 400 while ``response_format`` is in
:data:`redlite.server.schemas.UNSUPPORTED_FIELDS`). ``max_output_tokens`` -> ``max_tokens``;
``prompt_cache_key`` -> the session key.

Errors: :class:`redlite.server.errors.APIError` (400) naming the offending field; an error of
the chat service names a chat field, which :func:`responses_param` turns into the Responses one.
"""

from __future__ import annotations

import logging

from redlite.core.chat import ChatRequest
from redlite.engine.base import SamplingParams
from redlite.server.errors import APIError
from redlite.server.reasoning_token import decode_reasoning
from redlite.server.responses_schemas import AllowedToolsChoice, ReasoningItem, ResponsesRequest
from redlite.server.schemas import UNSUPPORTED_FIELDS

log = logging.getLogger("redlite.server.responses")

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _parts_text(parts) -> str:
    """The text of a string or of text / refusal parts (media parts are refused by the model)."""
    if isinstance(parts, str):
        return parts
    return "".join(part.text if part.type != "refusal" else part.refusal for part in parts)


def reasoning_text(item: ReasoningItem) -> tuple[str, bool]:
    """(the reasoning a replayed ``reasoning`` item carries, whether it had an
    ``encrypted_content`` of another server, ignored; see the module docstring)."""
    if item.encrypted_content:
        text = decode_reasoning(item.encrypted_content)
        if text is not None:
            return text, False
    foreign = bool(item.encrypted_content)
    parts = [p.text for p in item.content or [] if p.type == "reasoning_text"]
    if parts:
        return "".join(parts), foreign
    return "\n\n".join(p.text for p in item.summary if p.type == "summary_text"), foreign


class _History:
    """Accumulates messages; the open assistant message collects content and calls."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages = messages
        self.assistant: dict | None = None
        self.reasoning: str | None = None
        self.foreign = 0  # reasoning items whose encrypted_content was ignored

    def flush(self) -> None:
        if self.assistant is not None:
            self.messages.append(self.assistant)
            self.assistant = None

    def open_assistant(self) -> dict:
        if self.assistant is None:
            self.assistant = {"role": "assistant", "content": None}
            if self.reasoning is not None:
                self.assistant["reasoning_content"] = self.reasoning
                self.reasoning = None
        return self.assistant

    def add(self, item, skipped: list[str]) -> None:
        kind = item.type
        if kind == "message":
            role = _ROLES[item.role]
            text = _parts_text(item.content)
            if role == "assistant":
                message = self.open_assistant()
                message["content"] = (message["content"] or "") + text
            else:
                self.flush()
                self.messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            if self.assistant is not None and (self.assistant["content"] or self.assistant.get("tool_calls")):
                self.flush()
            text, foreign = reasoning_text(item)
            self.foreign += foreign
            if self.assistant is not None:
                self.assistant["reasoning_content"] = self.assistant.get("reasoning_content", "") + text
            else:
                self.reasoning = (self.reasoning or "") + text
        elif kind == "function_call":
            self.open_assistant().setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments or "{}"}})
        elif kind == "function_call_output":
            self.flush()
            self.messages.append({"role": "tool", "tool_call_id": item.call_id,
                                  "content": _parts_text(item.output)})
        else:
            skipped.append(str(kind))


def convert_input(body: ResponsesRequest, history: list[dict] | None = None) -> list[dict]:
    """The OpenAI-shaped messages of ``body`` after ``history`` (a stored conversation)."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages.extend(history or [])
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    builder, skipped = _History(messages), []
    for item in body.input:
        builder.add(item, skipped)
    builder.flush()
    if skipped:
        log.info("responses: skipping %d input item(s) of unsupported types: %s", len(skipped),
                 ", ".join(sorted(set(skipped))))
    if builder.foreign:
        log.info("responses: %d reasoning item(s) carry an encrypted_content of another server: "
                 "ignored, their reasoning_text or summary used", builder.foreign)
    return messages


def convert_tools(body: ResponsesRequest) -> list[dict]:
    """OpenAI chat function tools of ``body``; other tool types skipped with one log line."""
    tools, skipped = [], []
    for tool in body.tools or []:
        if tool.type != "function":
            skipped.append(tool.type)
            continue
        function = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
        if tool.description:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    if skipped:
        log.info("responses: skipping %d tool(s) of types other than function: %s", len(skipped),
                 ", ".join(sorted(set(skipped))))
    return tools


def _tool_choice(choice) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, AllowedToolsChoice):
        return choice.mode
    return choice if isinstance(choice, str) else choice.name


def _allowed_tools(choice) -> list[str] | None:
    if not isinstance(choice, AllowedToolsChoice):
        return None
    return [tool.get("name") for tool in choice.tools if tool.get("type") == "function"]


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = (body.text.format if body.text else None) or {}
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind in ("json_object", "json_schema") and "response_format" in UNSUPPORTED_FIELDS:
        raise APIError(400, f"text.format {kind} (constrained output) is not supported by this "
                       "server yet", "text.format", "unsupported_field")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            what = "required" if fmt.get("schema") is None else "must be an object (a JSON schema)"
            raise APIError(400, f"text.format.schema: {what} for json_schema", "text.format.schema")
        return {"type": "json_schema", "schema": fmt["schema"], "strict": bool(fmt.get("strict"))}
    raise APIError(400, f"text.format.type: unsupported format {kind!r}", "text.format.type")


CHAT_TO_RESPONSES = {"messages": "input", "response_format": "text.format",
                     "max_tokens": "max_output_tokens"}
"""chat request field -> the Responses field it was converted from (where the names differ)."""


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat service error's ``param`` names (its first dotted segment
    renamed by :data:`CHAT_TO_RESPONSES`; message indices do not carry over, so they go too)."""
    if param is None:
        return None
    head = param.split(".", 1)[0]
    return CHAT_TO_RESPONSES.get(head, param)


def to_chat_request(body: ResponsesRequest, history: list[dict] | None = None) -> ChatRequest:
    """The :class:`ChatRequest` of a Responses body continuing ``history``."""
    kwargs = {}
    if body.reasoning is not None and body.reasoning.effort == "none":
        kwargs["enable_thinking"] = False
    request = ChatRequest(
        messages=convert_input(body, history), tools=convert_tools(body),
        tool_choice=_tool_choice(body.tool_choice), allowed_tools=_allowed_tools(body.tool_choice),
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        template_kwargs=kwargs, max_tokens=body.max_output_tokens,
        sampling=SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p),
        response_format=_response_format(body), session_key=body.prompt_cache_key)
    request.request_id = request.request_id.replace("req-", "resp_", 1)
    return request
