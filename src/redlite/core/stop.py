"""Stop sequences: validation of the OpenAI ``stop`` field and a streaming scanner (torch-free).

The rules come from the OpenAI API field ``stop`` (chat completions and completions) and our
issue "Stop sequences and exact streamed text":

* ``stop`` is a string or an array of up to 4 non-empty strings, each at most 256 bytes in
  UTF-8; ``null``/absent means no stop sequences. :func:`normalize_stop` checks this.
* Generated text is sent up to the earliest match of any stop string; the stop string itself
  and everything after it are never sent. :class:`StopScanner` does this incrementally on the
  text pieces produced by the incremental detokenizer, and holds back only a tail that could
  still turn into a stop sequence, so the concatenation of everything it emits equals the
  non-incremental result ``text[:earliest_match]`` (or the whole text when nothing matches).

Matching is exact, on Unicode code points: no case folding and no Unicode normalization (a
precomposed "ü" does not match "u" + U+0308). The detokenizer only hands over complete
characters, so a multi-byte character is never split between two pieces here.
"""

from __future__ import annotations

from typing import Any

from redlite.core.kmp import prefix_function

MAX_STOP_SEQUENCES = 4
"""Most stop strings one request may give (OpenAI ``stop``: "up to 4 sequences")."""

MAX_STOP_BYTES = 256
"""Longest allowed stop string, in bytes of its UTF-8 encoding."""


def normalize_stop(value: Any) -> list[str]:
    """Validate the OpenAI ``stop`` field and return it as a list of strings.

    Args:
        value: the decoded JSON value of ``stop``: ``None``, a ``str``, or a ``list`` of ``str``.

    Returns:
        ``[]`` for ``None`` or an empty list, ``[value]`` for a string, else a copy of the list
        (order kept, duplicates kept; they are harmless to the scanner).

    Raises:
        ValueError: when ``value`` is of any other type (number, bool, dict, ...), when a list
            has more than :data:`MAX_STOP_SEQUENCES` items or an item that is not a string, or
            when any string is empty or longer than :data:`MAX_STOP_BYTES` bytes in UTF-8.
            The message is meant for the client; the HTTP layer answers 400 with
            ``param: "stop"``.
    """
    if value is None:
        return []
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list):
        if len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(
                f"'stop' may contain at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}"
            )
        items = list(value)
    else:
        raise ValueError(
            f"'stop' must be a string or an array of strings, got {_json_type(value)}"
        )
    for i, item in enumerate(items):
        where = "'stop'" if isinstance(value, str) else f"'stop[{i}]'"
        if not isinstance(item, str):
            raise ValueError(f"{where} must be a string, got {_json_type(item)}")
        if not item:
            raise ValueError(f"{where} must not be empty")
        size = len(item.encode("utf-8", errors="surrogatepass"))
        if size > MAX_STOP_BYTES:
            raise ValueError(
                f"{where} is {size} bytes in UTF-8; the limit is {MAX_STOP_BYTES} bytes"
            )
    return items


def _json_type(value: Any) -> str:
    """Name of ``value``'s JSON type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


class StopScanner:
    """Cuts a stream of generated text at the earliest stop sequence.

    Feed the text pieces of one generation, in order, to :meth:`push`; send what it returns.
    When generation ends without a stop (end of turn, ``max_tokens``), call :meth:`flush` and
    send what it returns too.

    Rules:

    * Earliest start wins: among all occurrences of all stop strings in the whole generated
      text, the one that starts first decides the cut; output is the text before it.
    * Same start: the shortest stop string is reported (:attr:`matched`). The emitted text is
      the same whichever one is chosen, and the shortest is known first, so the scanner stops
      at once instead of waiting for more tokens that a longer one would need (tokens that
      would be generated only to be thrown away).
    * Held back: a tail of the pending text that is a proper prefix of some stop string is
      not sent until it either completes a stop (dropped) or stops matching (sent). Text
      before a complete match is also held while an earlier-starting partial match is still
      open (stops ``["abcd", "bc"]`` on ``"abc"``: nothing after ``"a"`` is sent yet).
    * After a stop, :meth:`push` returns ``("", True)`` for every further piece.
    * With no stop strings, :meth:`push` returns its input at once.

    Cost: each stop string keeps a KMP automaton state (the length of the longest suffix of
    the pending text that is a prefix of it), so a push does work proportional to the new text
    times the number of stop strings (amortized), independent of the text generated so far.
    The pending (held-back) text is always shorter than the longest stop string. A push whose
    text holds none of the stops' first characters, with nothing pending, costs one C-level
    scan of the text.
    """

    __slots__ = (
        "_stops",
        "_pi",
        "_state",
        "_firsts",
        "_pending",
        "_match",
        "_matched",
        "_stopped",
        "_flushed",
    )

    def __init__(self, stops: list[str]) -> None:
        """Args:
            stops: stop strings, usually the result of :func:`normalize_stop`. Any number is
                accepted here (the limit of 4 is the API's, checked by ``normalize_stop``).

        Raises:
            ValueError: if a stop string is empty (it would match before any output).
            TypeError: if an item is not a ``str``.
        """
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must not be empty")
        self._stops: tuple[str, ...] = tuple(stops)
        self._pi: tuple[list[int], ...] = tuple(prefix_function(s) for s in self._stops)
        # _state[k]: length of the longest suffix of _pending that is a proper prefix of stop k,
        # or -1 once stop k has matched completely (it can no longer give an earlier match).
        self._state: list[int] = [0] * len(self._stops)
        self._firsts: frozenset[str] = frozenset(s[0] for s in self._stops)
        self._pending: str = ""
        # Start (index into _pending) of the earliest complete match found so far, while an
        # earlier-starting partial match is still open; None when there is none.
        self._match: int | None = None
        self._matched: str | None = None
        self._stopped: bool = False
        self._flushed: bool = False

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings, as given."""
        return self._stops

    @property
    def stopped(self) -> bool:
        """True once a stop sequence has matched (from :meth:`push` or :meth:`flush`); the
        request's ``finish_reason`` is then ``"stop"``."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output (for logs / ``stop_reason``), else None."""
        return self._matched

    @property
    def pending(self) -> str:
        """Text received but not yet emitted (shorter than the longest stop string)."""
        return self._pending

    def push(self, text: str) -> tuple[str, bool]:
        """Take the next piece of generated text.

        Args:
            text: the next decoded piece (complete characters; may be empty).

        Returns:
            ``(emit, stopped)``: ``emit`` is the text safe to send now (possibly empty);
            ``stopped`` is True when a stop sequence has matched, in which case ``emit`` is the
            last output of this generation and generation should end.

        Raises:
            RuntimeError: if called after :meth:`flush` without a stop having matched.
        """
        if self._stopped:
            return "", True
        if self._flushed:
            raise RuntimeError("StopScanner.push() called after flush()")
        if not self._stops:
            return text, False
        if not self._pending and self._firsts.isdisjoint(text):
            return text, False  # fast path: no stop can start in this piece

        buf = self._pending + text
        stops, pis, state = self._stops, self._pi, self._state
        match = self._match
        nstops = len(stops)
        for i in range(len(self._pending), len(buf)):
            ch = buf[i]
            for k in range(nstops):
                q = state[k]
                if q < 0:
                    continue
                stop = stops[k]
                pi = pis[k]
                while q and stop[q] != ch:
                    q = pi[q - 1]
                if stop[q] == ch:
                    q += 1
                if q == len(stop):
                    start = i + 1 - q
                    if match is None or start < match:
                        match = start
                        self._matched = stop
                    q = -1
                state[k] = q
            if match is not None:
                # Decide as soon as no open partial match starts before the complete one.
                end = i + 1
                if all(q <= 0 or end - q >= match for q in state):
                    self._stopped = True
                    self._pending = ""
                    self._match = None
                    return buf[:match], True

        # Hold back from the earliest start of an open partial match (and keep any complete
        # match that it might still pre-empt).
        end = len(buf)
        hold = min((end - q for q in state if q > 0), default=end)
        if match is not None:
            hold = min(hold, match)
            self._match = match - hold
        self._pending = buf[hold:]
        return buf[:hold], False

    def flush(self) -> str:
        """End the stream (generation finished without a stop: end of turn or ``max_tokens``)
        and return the held-back text.

        If the pending text holds a complete match that was waiting only on an earlier partial
        match, the partial one can no longer complete: the output is cut at the complete one,
        and :attr:`stopped` becomes True (so ``finish_reason`` should be ``"stop"``).

        Returns:
            The remaining text to send ("" after a stop, or when nothing is held back).
            Calling it again returns "".
        """
        if self._stopped:
            return ""
        out = self._pending
        if self._match is not None:
            out = out[: self._match]
            self._stopped = True
        self._pending = ""
        self._match = None
        self._state = [0] * len(self._stops)
        self._flushed = True
        return out
