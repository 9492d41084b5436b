"""A trace's client: builds each turn's request from the session history and feeds the model's
actual answer back the way that client would (see ``make_traces.py`` for the trace format).

History is kept as OpenAI chat messages in two forms per session: ``sent`` (what the client
sends: reasoning stripped, argument keys sorted, aider edits) and ``ideal`` (the answers exactly as
generated, the client's own edits applied), whose rendering gives the tokens *new since the
previous turn* (client changes only, never the server's answer sent back in another form).
"""

from __future__ import annotations

import json


def client_form(answer: dict, client: dict) -> dict:
    """The assistant message the client sends back for ``answer`` (a chat message dict)."""
    message = {"role": "assistant", "content": answer.get("content") or ""}
    if answer.get("reasoning_content") and not client["strip_reasoning"]:
        message["reasoning_content"] = answer["reasoning_content"]
    if answer.get("tool_calls"):
        calls = []
        for c in answer["tool_calls"]:
            arguments = c["function"]["arguments"]
            if client["sort_keys"]:
                try:
                    arguments = json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
                except ValueError:
                    pass
            calls.append({"id": c["id"], "type": "function",
                          "function": {"name": c["function"]["name"], "arguments": arguments}})
        message["tool_calls"] = calls
    return message


def expand(add: list[dict], previous: dict | None) -> list[dict]:
    """Turn a trace's ``add`` entries into chat messages; tool results answer the previous answer's
    calls in order (as a user message when the model made no call, e.g. with a real model)."""
    out = []
    calls = (previous or {}).get("tool_calls") or []
    for entry in add:
        if entry["role"] != "tool":
            out.append(dict(entry))
        elif not calls:
            out.append({"role": "user", "content": "\n\n".join(entry["results"])})
        else:
            results = entry["results"]
            for i, c in enumerate(calls):
                # the last result carries the next answer script: it answers the last call
                text = results[i] if i < len(calls) - 1 and i < len(results) - 1 else (
                    results[-1] if i == len(calls) - 1 else "(no output)")
                out.append({"role": "tool", "tool_call_id": c["id"], "content": text})
    return out


class Session:
    """One conversation (main agent or sub-agent) of a trace."""

    def __init__(self, trace: dict) -> None:
        self.client = trace["client"]
        self.sent: list[dict] = [{"role": "system", "content": trace["system"]}]
        self.ideal: list[dict] = [{"role": "system", "content": trace["system"]}]
        self.last_answer: dict | None = None

    def next_messages(self, turn: dict) -> tuple[list[dict], list[dict]]:
        """(messages sent, ideal messages) of this turn's request."""
        if self.client["aider"] and turn.get("edit_previous_user"):
            for history in (self.sent, self.ideal):
                users = [m for m in history if m["role"] == "user"]
                if users:
                    users[-1]["content"] = turn["edit_previous_user"]
        new = expand(turn["add"], self.last_answer)
        self.sent.extend(json.loads(json.dumps(new)))
        self.ideal.extend(json.loads(json.dumps(new)))
        if turn.get("file_block"):
            tail = [{"role": "user", "content": turn["file_block"]}, {"role": "assistant", "content": "Ok."}]
            return self.sent[:-1] + tail + self.sent[-1:], self.ideal[:-1] + tail + self.ideal[-1:]
        return list(self.sent), list(self.ideal)

    def answered(self, answer: dict, turn: dict) -> None:
        """Record the model's answer (a chat message dict) after this turn."""
        self.last_answer = answer
        self.sent.append(client_form(answer, self.client))
        ideal = {"role": "assistant", "content": answer.get("content") or ""}
        for key in ("reasoning_content", "tool_calls"):
            if answer.get(key):
                ideal[key] = answer[key]
        self.ideal.append(ideal)


# ---- wires: chat messages -> request body, response body -> chat message ----

def anthropic_body(messages: list[dict], tools: list[dict], nonce: str | None) -> dict:
    system = [{"type": "text", "text": messages[0]["content"]}]
    if nonce:
        system.insert(0, {"type": "text", "text": nonce})
    out: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            blocks = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": "x"})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": json.loads(c["function"]["arguments"] or "{}")})
            out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": "user", "content": m["content"]})
    return {"system": system, "messages": out, "max_tokens": 8192,
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in tools]}


def anthropic_answer(body: dict) -> dict:
    message: dict = {"role": "assistant", "content": ""}
    for block in body["content"]:
        if block["type"] == "thinking":
            message["reasoning_content"] = block["thinking"]
        elif block["type"] == "text":
            message["content"] += block["text"]
        elif block["type"] == "tool_use":
            message.setdefault("tool_calls", []).append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
    return message


def responses_body(messages: list[dict], tools: list[dict]) -> dict:
    items: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        elif m["role"] == "assistant":
            if m.get("content"):
                items.append({"role": "assistant", "content": m["content"]})
            for c in m.get("tool_calls") or []:
                items.append({"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return {"instructions": messages[0]["content"], "input": items, "max_output_tokens": 8192,
            "tools": [{"type": "function", **t["function"]} for t in tools]}


def responses_answer(body: dict) -> dict:
    message: dict = {"role": "assistant", "content": ""}
    for item in body["output"]:
        if item["type"] == "message":
            message["content"] += "".join(p.get("text", "") for p in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return message


def request_for(trace: dict, turn: dict, messages: list[dict], model: str) -> tuple[str, dict, dict]:
    """(path, JSON body, headers) of one turn on the trace's wire."""
    session = trace["sessions"].get(turn["session"], {})
    extra = dict(session.get("body", {}))
    if trace["client"]["temperature"] is not None:
        extra["temperature"] = trace["client"]["temperature"]
    if trace["wire"] == "anthropic":
        return "/v1/messages", {"model": model, **anthropic_body(messages, trace["tools"], turn.get("nonce")),
                                **{k: v for k, v in extra.items() if k != "prompt_cache_key"}}, session.get("headers", {})
    if trace["wire"] == "responses":
        return "/v1/responses", {"model": model, **responses_body(messages, trace["tools"]), **extra}, session.get("headers", {})
    body = {"model": model, "messages": messages, "max_tokens": 8192, **extra}
    if trace["tools"]:
        body["tools"] = trace["tools"]
    return "/v1/chat/completions", body, session.get("headers", {})


def answer_of(trace: dict, body: dict) -> dict:
    if trace["wire"] == "anthropic":
        return anthropic_answer(body)
    if trace["wire"] == "responses":
        return responses_answer(body)
    message = body["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}
