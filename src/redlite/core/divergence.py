"""Where and why a new prompt leaves the held ids: the text of a cache-miss log line (torch-free).

A token mismatch inside the tokens the server generated for the previous answer means the
client sent that answer back in another form than it was generated (the chat template
re-serialized the tool-call arguments, dropped the reasoning, or the text re-tokenized
differently); a mismatch before it means an earlier message changed. The planner rewinds (or
restores) to the first difference either way; this only explains it.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

SHOWN_TOKENS = 12  #: tokens decoded on each side of a difference


def describe_divergence(tokenizer: Any, held_next: Sequence[int], prompt_next: Sequence[int],
                        common: int, answer_start: int | None) -> str:
    """One log fragment: the token position, the first differing text on each side and why.

    held_next, prompt_next: the held ids and the prompt's ids from position ``common`` on (at
    most :data:`SHOWN_TOKENS` are decoded, each text quoted with repr; an empty one: that side
    ends there). answer_start: position in the held ids where the previous generated answer
    begins (None when unknown).
    """
    if not held_next or not prompt_next:
        return f"at token {common}: one side ends there"
    held_text = tokenizer.decode(list(held_next[:SHOWN_TOKENS]))
    prompt_text = tokenizer.decode(list(prompt_next[:SHOWN_TOKENS]))
    if answer_start is not None and common >= answer_start:
        why = (f"inside the previous answer ({common - answer_start} tokens in): the client's "
               "copy re-renders differently from the generated tokens")
    else:
        why = "a message differs from the held conversation's"
    return f"at token {common}: held {held_text!r} vs prompt {prompt_text!r} ({why})"


def describe_message(tokenizer: Any, prompt: Sequence[int], common: int, message_ends: Sequence[int],
                     messages: Sequence[tuple[str, str | None]]) -> str:
    """Which message of the prompt the first difference lies in: ``message=INDEX role=ROLE
    [tool_call=ID] offset=BYTES`` (bytes of the rendered message, template markup included,
    before the difference). ``messages``: (role, tool-call id or None) per message, aligned with
    ``message_ends`` (token positions); "" when they are not aligned. Past the last message:
    ``message=generation-prompt``."""
    if not messages or len(messages) != len(message_ends):
        return ""
    index = bisect.bisect_right(list(message_ends), common)
    if index >= len(messages):
        return f"message=generation-prompt offset={_bytes(tokenizer, prompt, message_ends[-1], common)}"
    start = message_ends[index - 1] if index else 0
    role, call_id = messages[index]
    call = f" tool_call={call_id}" if call_id else ""
    return f"message={index} role={role}{call} offset={_bytes(tokenizer, prompt, start, common)}"


def _bytes(tokenizer: Any, prompt: Sequence[int], start: int, end: int) -> int:
    decode = getattr(tokenizer, "decode_rendered", None) or tokenizer.decode
    return len(decode(list(prompt[start:end])).encode("utf-8"))
