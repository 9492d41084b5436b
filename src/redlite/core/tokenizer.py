"""What the server core needs from a tokenizer (torch-free protocol).

Two implementations: :class:`redlite.core.byte_tokenizer.ByteTokenizer` (the echo engine's,
UTF-8 bytes) and ``redlite.loading.tokenizer.HFTokenizer`` (transformers/tokenizers, used with
the torch engine).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator, Protocol, Sequence, overload

#: the first character of the markers put into message contents for a marked render (message
#: boundaries, replay splices): ASCII, so a marked text stays one byte per character (a U+2063
#: made every copy, concatenation and comparison of a long conversation's text twice as wide),
#: and not whitespace, so a template's ``trim`` leaves it in place
MARKER_LEAD = "\x07"


class RenderedPrompt:
    """A chat prompt rendered by the chat template and tokenized.

    token_ids: the prompt's token ids (list[int]).
    message_ends: token positions (counts of tokens) at which each message's rendering ends,
        ascending, each <= len(token_ids); used as checkpoint positions for hybrid models. May be
        given as a zero-argument callable: it is then computed on first access (so a prompt
        refused for its length never pays for it), once, in the thread that reads it.
    text: the rendered text (for logs and debugging).
    cut_count: None, or char position -> the token count there when the ids split exactly at
        it (tokenizing ``text[:p]`` and ``text[p:]`` apart gives ``token_ids[:n]`` and
        ``token_ids[n:]``), else None.
    """

    __slots__ = ("token_ids", "text", "_ends", "cut_count")

    def __init__(self, token_ids: list[int], message_ends: list[int] | Callable[[], list[int]],
                 text: str, cut_count: Callable[[int], int | None] | None = None) -> None:
        self.token_ids = token_ids
        self.text = text
        self._ends = message_ends
        self.cut_count = cut_count

    @property
    def message_ends(self) -> list[int]:
        if callable(self._ends):
            self._ends = list(self._ends())
        return self._ends

    def deferred_ends(self) -> Sequence[int]:
        """``message_ends`` without computing them now: the list when known, else a
        :class:`LazyPositions` that computes them (here, once) when first read."""
        return self._ends if not callable(self._ends) else LazyPositions(lambda: self.message_ends)

    def __repr__(self) -> str:
        return f"RenderedPrompt({len(self.token_ids)} tokens, {self.text[:40]!r}...)"


class LazyPositions(Sequence[int]):
    """A read-only sequence of token positions computed by ``compute()`` (a zero-argument
    callable giving ints) on first use, once, in the thread that reads it; equal to a list
    of the same ints. For work the first token need not wait for (message boundaries)."""

    __slots__ = ("_compute", "_items")

    def __init__(self, compute: Callable[[], Iterable[int]]) -> None:
        self._compute: Callable[[], Iterable[int]] | None = compute
        self._items: list[int] | None = None

    @property
    def known(self) -> bool:
        """Whether they have been computed."""
        return self._items is not None

    def _get(self) -> list[int]:
        if self._items is None:
            compute, self._compute = self._compute, None
            self._items = list(compute())  # type: ignore[misc]
        return self._items

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index):
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[int]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyPositions):
            other = other._get()
        return isinstance(other, (list, tuple)) and self._get() == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._items) if self._items is not None else "LazyPositions(<not computed>)"


class IncrementalDecoder(Protocol):
    """Turns generated token ids into text, one token at a time.

    ``push`` returns only complete text: bytes of a character split across tokens are held
    back until the character is complete, never emitted as U+FFFD or half-sent.
    """

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class PromptTooLong(ValueError):
    """A rendered prompt shown by a lower bound, before tokenizing it, to have more tokens than
    the tokenizer's ``prompt_limit``. at_least: that bound; limit: the limit."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the prompt has at least {at_least} tokens, more than the context of "
                         f"{limit} tokens")
        self.at_least, self.limit = at_least, limit


_UNLIMITED: ContextVar[bool] = ContextVar("redlite_unlimited_prompt", default=False)


@contextmanager
def no_prompt_limit() -> Iterator[None]:
    """Inside it (this thread or task), :func:`prompt_limit_of` is None: renders for a token
    count, which answers prompts of any length, skip the tokenizer's ``prompt_limit`` check."""
    token = _UNLIMITED.set(True)
    try:
        yield
    finally:
        _UNLIMITED.reset(token)


def prompt_limit_of(tokenizer: object) -> int | None:
    """The ``prompt_limit`` a render applies now: the tokenizer's, None inside
    :func:`no_prompt_limit`."""
    return None if _UNLIMITED.get() else getattr(tokenizer, "prompt_limit", None)


def min_prompt_tokens(texts: Iterable[object], max_token_chars: int | None) -> int:
    """A lower bound on the tokens a prompt containing ``texts`` takes, without rendering or
    tokenizing: the characters of its string texts (other items count 0) over the most
    characters one token covers. 0 when ``max_token_chars`` is unknown (None or 0)."""
    if not max_token_chars:
        return 0
    chars = sum(len(text) for text in texts if isinstance(text, str))
    return -(-chars // max_token_chars)


def message_texts(messages: Iterable[object]) -> Iterable[str]:
    """The text of every message's content (strings and text parts)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def user_turns(messages: Iterable[object]) -> int:
    """How many user messages are directly followed by an assistant message (turns a template
    renders as two messages, whatever it does with runs of one role)."""
    turns, previous = 0, None
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        turns += previous == "user" and role == "assistant"
        previous = role
    return turns


def min_chat_tokens(messages: list, tokenizer: object) -> int:
    """A lower bound on the tokens of a chat prompt, without rendering it (linear, cheap): its
    content characters (:func:`min_prompt_tokens`) plus, per user -> assistant turn, the special
    tokens the template writes for one (the tokenizer's optional ``turn_tokens``)."""
    chars = min_prompt_tokens(message_texts(messages), getattr(tokenizer, "max_token_chars", None))
    per_turn = getattr(tokenizer, "turn_tokens", 0) or 0
    return chars + (user_turns(messages) * per_turn if per_turn else 0)


class Tokenizer(Protocol):
    """Tokenizer + chat template of the served model.

    max_token_chars (optional attribute): the most characters of text one token covers, for
    :func:`min_prompt_tokens`; absent or None when unknown.
    prompt_limit (optional attribute): when set (the server sets the context size),
    ``render_chat`` may raise :class:`PromptTooLong` for a rendering that provably exceeds it,
    before the work of tokenizing it (never inside :func:`no_prompt_limit`: it reads
    :func:`prompt_limit_of`).
    turn_tokens (optional attribute): a lower bound on the special tokens the chat template
    writes per user -> assistant turn (for :func:`min_chat_tokens`); absent or 0 when unknown.
    """

    vocab_size: int
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Tokenize a raw completion prompt (adds BOS where the model's config asks for it)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        ...

    def render_chat(self, messages: list[dict], **template_kwargs) -> RenderedPrompt:
        """Render ``messages`` (dicts with ``role`` and string ``content``) with the chat
        template, adding the assistant generation prompt; tokenize without adding specials
        twice. Linear in the conversation's size (message_ends come from a few renders, never
        one per prefix); safe to call from several threads at once."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Ids of message text as the chat template's content is tokenized (special-token text
        as plain text, no BOS): the assistant prefill a continued answer follows."""
        ...

    def incremental_decoder(self) -> IncrementalDecoder: ...
