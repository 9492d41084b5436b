"""How many special tokens a chat template writes per conversation turn, learned once by probing.

A conversation far too long for the context should be refused before its whole rendering is
done: 10,000 tiny messages cost a full Jinja render (all of it holding the GIL, so every other
request in the process waits) only to be refused afterwards. The content characters alone do
not show it (``m1``, ``m2``... are short); the template's markup does: ChatML writes
``<|im_start|>`` and ``<|im_end|>`` around every message. :func:`turn_markup_tokens` renders
three short conversations of ``k`` = 1, 2, 3 user/assistant pairs (then a user message, with
the generation prompt, like a real request) and counts the special tokens in each: the per-pair
increase is a lower bound on the special tokens each user -> assistant turn adds to any
conversation, provided it is the same from 1 to 2 and from 2 to 3 pairs (checked; 0 otherwise).
Special tokens are always tokens of their own, so the bound holds whatever the text around them.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("redlite.loading")

#: render(messages) -> rendered text with the generation prompt
Render = Callable[[list], str]


def _probe(pairs: int) -> list[dict]:
    messages: list[dict] = []
    for i in range(pairs):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return messages + [{"role": "user", "content": "q"}]


def turn_markup_tokens(render: Render, count_specials: Callable[[str], int]) -> int:
    """The special tokens the template adds per user -> assistant pair (see the module
    docstring); 0 when the template refuses the probe or does not grow linearly with it.
    count_specials(text): the special tokens in a rendered text."""
    try:
        counts = [count_specials(render(_probe(k))) for k in (1, 2, 3)]
    except Exception as error:  # a template may refuse the probe (e.g. needs a system message)
        log.info("chat template probe failed (%s: %s); no per-turn bound", type(error).__name__, error)
        return 0
    step = counts[1] - counts[0]
    if step <= 0 or counts[2] - counts[1] != step:
        return 0
    return step

