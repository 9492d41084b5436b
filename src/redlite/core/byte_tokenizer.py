"""The echo engine's tokenizer: one token per UTF-8 byte plus four special tokens.

Ids 0-255 are bytes; 256 ``<|system|>``, 257 ``<|user|>``, 258 ``<|assistant|>``,
259 ``<|end|>`` (end of turn), 260 ``<|tool|>``. The chat template renders each message as
``<|role|>content<|end|>`` and ends with ``<|assistant|>`` (``<|assistant|><think>\n`` with
``enable_thinking=True``). Its rendering of tools, calls and reasoning (deterministic, in the
hermes / qwen3 markup that the output scanner parses):

* ``tools``: ``<tools>\n`` + one JSON object per line + ``\n</tools>``, appended (after a blank
  line) to the first system message, or as a system message of its own;
* assistant: ``<think>\nREASONING\n</think>\n\n`` when it has reasoning, then the content, then
  each call as ``<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`` (``json.dumps``
  with its default separators; items joined by ``\n``);
* tool results: ``<|tool|>content<|end|>``.

Optionally (``ByteTokenizer(merged=...)``, for tests of re-tokenization) ids 261, 262, ...
spell the given multi-byte strings: :meth:`ByteTokenizer.encode` never writes them (text is
bytes), only a generator does (the echo engine with the same ``merged``), as a sampled model
writes a token that its tokenizer would spell otherwise.

So an echo answer of exactly that call text (the echo engine repeats the last user or tool
message) comes back as a parsed tool call, and the re-rendered history gives back the same bytes.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Sequence

from redlite.core.tokenizer import RenderedPrompt

SPECIAL_TOKENS = {"<|system|>": 256, "<|user|>": 257, "<|assistant|>": 258, "<|end|>": 259,
                  "<|tool|>": 260}
ROLE_TOKENS = {"system": 256, "user": 257, "assistant": 258, "tool": 260}
USER, ASSISTANT, END, TOOL = 257, 258, 259, 260
VOCAB_SIZE = 261
CHAT_TEMPLATE_SOURCE = "byte template: renders tools, <tool_call> hermes calls, <think> reasoning"
"""What format detection reads for this tokenizer (see redlite.core.chat_render.detect_formats)."""
_SPECIAL_PATTERN = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))


class _ByteDecoder:
    """Incremental UTF-8 decoding: an incomplete character is held until complete."""

    def __init__(self, merged: tuple[bytes, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._merged = merged

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            k = token_id - VOCAB_SIZE
            return self._decoder.decode(self._merged[k]) if 0 <= k < len(self._merged) else ""
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        """End of generation: an incomplete trailing character is dropped, not sent as U+FFFD
        (as with the tokenizers library's DecodeStream, which never emits it)."""
        pending, _ = self._decoder.getstate()
        self._decoder.reset()
        return pending.decode("utf-8", errors="ignore")


class ByteTokenizer:
    """UTF-8 byte tokenizer (see module docstring); special-token strings in raw text are
    encoded as their special ids."""

    eos_token_ids = frozenset({END})
    max_token_chars = max(len(s) for s in SPECIAL_TOKENS)  # a byte is at most one character
    turn_tokens = 4  # a user and an assistant message: a role token and <|end|> each

    def __init__(self, merged: tuple[bytes, ...] = ()) -> None:
        """merged: the multi-byte strings of ids 261, 262, ... (module docstring)."""
        self.merged = tuple(bytes(m) for m in merged)
        self.vocab_size = VOCAB_SIZE + len(self.merged)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes of a byte or merged id; None for a special token."""
        if 0 <= token_id < 256:
            return bytes([token_id])
        k = token_id - VOCAB_SIZE
        return self.merged[k] if 0 <= k < len(self.merged) else None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        position = 0
        for match in _SPECIAL_PATTERN.finditer(text):
            ids.extend(text[position:match.start()].encode("utf-8"))
            ids.append(SPECIAL_TOKENS[match.group()])
            position = match.end()
        ids.extend(text[position:].encode("utf-8"))
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        if not self.merged:
            return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")
        return b"".join(self.token_bytes(t) or b"" for t in token_ids).decode("utf-8", errors="replace")

    def encode_text(self, text: str) -> list[int]:
        """Ids of message text as :meth:`render_chat` writes content: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of rendered template text (as :meth:`render_chat` tokenizes it)."""
        return self.encode(text)

    def decode_rendered(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with the special tokens written out."""
        names = {v: k for k, v in SPECIAL_TOKENS.items()}
        out, run = [], bytearray()
        for t in token_ids:
            if t < 256 or t - VOCAB_SIZE in range(len(self.merged)):
                run += self.token_bytes(t)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(names.get(t, ""))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    chat_template_source = CHAT_TEMPLATE_SOURCE

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    enable_thinking: bool = False, **_: object) -> RenderedPrompt:
        """Render with the byte template (module docstring); unknown template kwargs are
        ignored, as Jinja templates ignore unused variables."""
        parts = [(m["role"], _message_text(m)) for m in messages]
        if tools:
            block = "<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>"
            if parts and parts[0][0] == "system":
                parts[0] = ("system", parts[0][1] + "\n\n" + block)
            else:
                parts.insert(0, ("system", block))
        ids: list[int] = []
        ends: list[int] = []
        for role, text in parts:
            ids.append(ROLE_TOKENS.get(role, USER))
            ids.extend(text.encode("utf-8"))
            ids.append(END)
            ends.append(len(ids))
        prompt = "<|assistant|>" + ("<think>\n" if enable_thinking else "")
        ids.append(ASSISTANT)
        if enable_thinking:
            ids.extend(b"<think>\n")
        text = "".join(f"<|{role}|>{body}<|end|>" for role, body in parts) + prompt
        if tools and not (messages and messages[0]["role"] == "system"):
            ends = ends[1:]  # the tools block is no message of the request
        return RenderedPrompt(ids, ends, text)

    def incremental_decoder(self) -> _ByteDecoder:
        return _ByteDecoder(self.merged)


def _message_text(message: dict) -> str:
    """A message's text in the byte template (tool calls and reasoning for an assistant)."""
    content = message.get("content") or ""
    if message["role"] != "assistant":
        return content
    items = [content] if content else []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments", {})
        body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
        items.append(f"<tool_call>\n{body}\n</tool_call>")
    text = "\n".join(items)
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        text = f"<think>\n{reasoning}\n</think>\n\n" + text
    return text
