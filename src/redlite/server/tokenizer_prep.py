"""The served tokenizer's lazily built tables, built once the server listens.

On first use a tokenizer builds: the chat template (compiled at the first render), the table
of token bytes the reuse planner reads at a fork (:mod:`redlite.core.same_bytes`) and
llguidance's vocabulary (:func:`redlite.core.grammar.grammar_tokenizer`, needed by tool
choices that force a call, JSON answers and logprobs; the slowest of the three).
:func:`start_tokenizer_prep` builds them on a background thread right after start-up, so
the first constrained request does not pay for them, while start-up (time to ``/health``)
does not wait for them either. A request arriving meanwhile waits only for the part it
needs (``grammar_tokenizer`` builds under a lock; the other two are cheap to build twice),
except that llguidance's build of its vocabulary (in Rust, from the tokenizer's JSON) holds the
GIL throughout: the event loop reads no request until it ends, so a request arriving in that
first fraction of a second waits for it (a known cost of this choice;
``bench/results/first-constrained-*``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("redlite.tokenizer")


def prepare_tokenizer(tokenizer: Any) -> list[str]:
    """Build ``tokenizer``'s tables now (see module docstring); returns the ones built (a
    tokenizer without grammar support skips that one)."""
    built = []
    if callable(getattr(tokenizer, "render_chat", None)):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
        built.append("chat template")
    if callable(getattr(tokenizer, "token_bytes", None)):
        tokenizer.token_bytes(0)
        built.append("token bytes")
    from redlite.core.grammar import grammar_tokenizer

    try:
        grammar_tokenizer(tokenizer)
        built.append("grammar vocabulary")
    except TypeError:  # no grammar support for this kind of tokenizer
        pass
    return built


def start_tokenizer_prep(tokenizer: Any) -> threading.Thread:
    """Run :func:`prepare_tokenizer` on a daemon thread (a failure is logged: the tables are
    then built on first use, as without it); logs what was built and how long it took."""
    def run() -> None:
        started = time.perf_counter()
        try:
            built = prepare_tokenizer(tokenizer)
        except Exception:  # noqa: BLE001 - built on first use instead
            log.exception("tokenizer tables not prepared; they are built on first use")
            return
        log.info("tokenizer tables ready in %.2f s after start-up (%s)", time.perf_counter() - started,
                 ", ".join(built) or "none")

    thread = threading.Thread(target=run, name="redlite-tokenizer-prep", daemon=True)
    thread.start()
    return thread
