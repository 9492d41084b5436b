"""Re-tokenized spans: where held and prompt ids differ but spell the same bytes (torch-free).

A client that sends back the text the model generated often re-tokenizes it differently (a
sampled answer, a token the model wrote that the tokenizer would split in two, arguments whose
bytes came back unchanged). From the first differing token, :func:`align_same_bytes` walks both
id sequences byte for byte: while the bytes agree, each stretch of differing ids that ends on a
token boundary on both sides is a *span*; the held ids are kept for it, so the prompt becomes
``held[:held_end] + prompt[prompt_end:]`` (same bytes, the held spelling) and the held state is
reused up to ``held_end`` instead of the first differing token.

A special (control) token matches only the same id: its text is not the model's text (a prompt
that writes ``<|im_end|>`` as plain bytes is not the end-of-turn token). The rule's one caller is
:func:`redlite.core.reuse.plan_reuse`; :func:`adopt_held_spelling` applies a plan's span to a
request (prompt ids and message boundaries).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

log = logging.getLogger("redlite.generation")

#: token id -> its bytes, or None for a special token (or one whose bytes are unknown)
TokenBytes = Callable[[int], "bytes | None"]


@dataclass(frozen=True)
class SameBytes:
    """The result of :func:`align_same_bytes`. spans: ``(held_start, held_end, prompt_start,
    prompt_end)`` of each stretch of differing ids that spell the same bytes, in order (token
    positions); between and after them the ids are equal. held_end / prompt_end: the aligned
    position the walk reached (``held[:held_end]`` and ``prompt[:prompt_end]`` spell the same
    bytes). nbytes: bytes of the spans (prompt side)."""

    spans: tuple[tuple[int, int, int, int], ...]
    held_end: int
    prompt_end: int
    nbytes: int

    def prompt_ids(self, held: Sequence[int], prompt: Sequence[int]) -> list[int]:
        """The prompt with the held spelling: ``held[:held_end] + prompt[prompt_end:]``."""
        return list(held[:self.held_end]) + list(prompt[self.prompt_end:])

    def map_position(self, position: int) -> int:
        """A prompt token position as a position of :meth:`prompt_ids` (a position inside a
        span, not a token boundary of the held spelling, maps to the span's start)."""
        starts = [s[2] for s in self.spans]
        k = bisect.bisect_right(starts, position) - 1
        if k < 0:
            return position
        held_start, held_end, prompt_start, prompt_end = self.spans[k]
        if position >= prompt_end:
            return position + held_end - prompt_end
        return held_start

    def describe(self) -> str:
        """One log fragment: how many spans, their tokens on each side and bytes."""
        held = sum(s[1] - s[0] for s in self.spans)
        prompt = sum(s[3] - s[2] for s in self.spans)
        first = self.spans[0]
        return (f"same bytes, other ids: {len(self.spans)} span(s) from token {first[2]}, "
                f"{prompt} prompt tok = {held} held tok ({self.nbytes} bytes); held ids kept "
                f"to {self.held_end}")


def _equal_run(a: Sequence[int], b: Sequence[int], i: int, j: int) -> int:
    """How many positions from ``a[i]`` and ``b[j]`` on hold equal ids."""
    limit = min(len(a) - i, len(b) - j)
    k, block = 0, 256
    while k + block <= limit and a[i + k:i + k + block] == b[j + k:j + k + block]:
        k += block
    while k < limit and a[i + k] == b[j + k]:
        k += 1
    return k


def align_same_bytes(held: Sequence[int], prompt: Sequence[int], start: int,
                     token_bytes: TokenBytes) -> SameBytes | None:
    """Walk ``held`` and ``prompt`` from ``start`` (their first differing position) while
    their bytes agree (see the module docstring). None when no span closes (the bytes differ
    before both sides reach a common token boundary). Linear in the tokens walked."""
    spans: list[tuple[int, int, int, int]] = []
    i = j = start
    end: tuple[int, int] | None = None
    region: tuple[int, int] | None = None  # (held, prompt) start of the open span
    pending_held = pending_prompt = b""    # bytes read on one side, not yet on the other
    nbytes = 0
    while True:
        if not pending_held and not pending_prompt:  # both sides at a token boundary
            if region is not None:
                spans.append((region[0], i, region[1], j))
                region = None
            run = _equal_run(held, prompt, i, j)
            i, j = i + run, j + run
            if spans:
                end = (i, j)
            if i >= len(held) or j >= len(prompt):
                break
            a, b = token_bytes(held[i]), token_bytes(prompt[j])
            if a is None or b is None:
                break
            region, pending_held, pending_prompt = (i, j), a, b
            i, j = i + 1, j + 1
            nbytes_at_region = nbytes
        common = min(len(pending_held), len(pending_prompt))
        if pending_held[:common] != pending_prompt[:common]:
            break
        nbytes += common
        pending_held, pending_prompt = pending_held[common:], pending_prompt[common:]
        if pending_held:
            piece = token_bytes(prompt[j]) if j < len(prompt) else None
            if piece is None:
                break
            pending_prompt, j = piece, j + 1
        elif pending_prompt:
            piece = token_bytes(held[i]) if i < len(held) else None
            if piece is None:
                break
            pending_held, i = piece, i + 1
    if region is not None:  # the open span did not close: its bytes are not counted
        nbytes = nbytes_at_region
    if end is None:
        return None
    return SameBytes(tuple(spans), end[0], end[1], nbytes)


def adopt_held_spelling(gen: Any, request: Any) -> Any:
    """The reuse plan of ``request`` against ``gen``'s held state (``gen.plan``); when it keeps
    held ids for re-tokenized spans (``plan.same_bytes``), ``request.prompt_ids`` and
    ``request.message_ends`` are rewritten to the held spelling (logged). Returns the plan."""
    plan = gen.plan(request.prompt_ids)
    same = plan.same_bytes
    if same is not None:
        before = len(request.prompt_ids)
        request.prompt_ids = same.prompt_ids(gen.held_ids, request.prompt_ids)
        request.message_ends = [same.map_position(p) for p in request.message_ends]
        session = f" session={request.session_key}" if request.session_key else ""
        log.info("%s reuse: %s; prompt %d -> %d tok%s", request.request_id, same.describe(),
                 before, len(request.prompt_ids), session)
    return plan
