"""The served model's tokenizer and chat template (tokenizers + jinja2; transformers only
where a directory needs it).

:class:`HFTokenizer` implements :class:`redlite.core.tokenizer.Tokenizer` on a
``tokenizers.Tokenizer``: tokenization, decoding and streaming decoding go through it (one
pipeline, so ``decode`` and the incremental decoder agree); chat rendering goes through
:class:`redlite.loading.chat_template.ChatTemplate` (the model's Jinja template).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from redlite.core.tokenizer import PromptTooLong, RenderedPrompt, prompt_limit_of
from redlite.loading.chat_template import ChatTemplate
from redlite.loading.message_bounds import PrefixRenders, message_boundaries
from redlite.loading.plain_specials import PlainSpecials, map_positions, special_strings
from redlite.loading.render_cache import RenderCache, input_key
from redlite.loading.segment_encoder import SegmentEncoder
from redlite.loading.streaming_decoder import StreamingDecoder
from redlite.loading.template_probe import turn_markup_tokens
from redlite.loading.text_pieces import offsets_boundary
from redlite.loading.tokenizer_files import read_plain
from redlite.loading.token_bytes import TokenBytes

logger = logging.getLogger("redlite.loading")

#: End-of-turn / end-of-text tokens of common chat models (ChatML, Llama 3, GPT-2 style);
#: each one present in the vocabulary is an eos id.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>")

# Files any one of which makes a directory hold a tokenizer transformers can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class HFTokenizer:
    """A Hugging Face tokenizer as redlite's :class:`redlite.core.tokenizer.Tokenizer`.

    vocab_size: ids the tokenizer knows (base vocabulary + added tokens; the model's
        embedding may have more rows).
    eos_token_ids: every id that ends a turn (see :func:`load_tokenizer`).
    max_token_chars: the most text characters one token covers (see
        :func:`redlite.core.tokenizer.min_prompt_tokens`), or None when unknown.
    prompt_limit: None, or the most tokens a chat prompt may have (see :meth:`render_chat`).
    bos_token_id: the tokenizer's BOS id, or None.
    add_bos: whether :meth:`encode` puts ``bos_token_id`` first: ``add_bos_token`` of
        ``tokenizer_config.json`` (a converted GGUF copies ``tokenizer.ggml.add_bos_token``
        there) when set, else whether the post-processor of ``tokenizer.json`` adds BOS
        (e.g. Llama 3's template).
    """

    def __init__(self, backend: Any, special_tokens: dict[str, str] | None = None,
                 chat_template: str | dict[str, str] | None = None, eos_token_ids: Iterable[int] = (),
                 add_bos: bool | None = None, transformers_tokenizer: Any = None,
                 directory: str | os.PathLike[str] | None = None) -> None:
        """backend: the ``tokenizers.Tokenizer``. special_tokens: the named special tokens
        (``{"bos_token": "<s>", "eos_token": ...}``, strings), given to the chat template too.
        chat_template: its Jinja source (or named sources), None when there is none.
        eos_token_ids: ids to treat as end of turn, in addition to the eos token and the
        :data:`END_OF_TURN_TOKENS` present in the vocabulary.
        add_bos: whether :meth:`encode` starts with BOS (``add_bos_token`` of
        ``tokenizer_config.json``); None: probe whether the tokenizer's post-processor
        (``tokenizer.json``) adds it.
        transformers_tokenizer / directory: the transformers tokenizer when one was loaded, else
        the directory to build it from when :attr:`transformers_tokenizer` is first read.
        """
        self._backend = backend
        self._transformers = transformers_tokenizer
        self._directory = directory
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._token_id("bos_token")

        ids = {int(i) for i in eos_token_ids}
        if self._token_id("eos_token") is not None:
            ids.add(self._token_id("eos_token"))
        for token in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None:
                ids.add(int(token_id))
        self.eos_token_ids: frozenset[int] = frozenset(ids)

        if add_bos is None:
            with_specials = backend.encode("a", add_special_tokens=True).ids
            without = backend.encode("a", add_special_tokens=False).ids
            add_bos = with_specials[:1] == [self.bos_token_id] and without[:1] != [self.bos_token_id]
        self.add_bos: bool = bool(add_bos) and self.bos_token_id is not None
        self.max_token_chars: int | None = _max_token_chars(backend)
        # tokenizes through encode_batch (no GIL held, unlike encode) in cached pieces
        self._segments = SegmentEncoder(backend)
        self.prompt_limit: int | None = None
        self._turn_tokens: tuple[str | None, int] | None = None
        self._plain_specials = PlainSpecials(special_strings(backend))
        self._token_bytes: TokenBytes | None = None
        self._renders = RenderCache()
        self._prefix_renders = PrefixRenders()

    @classmethod
    def from_transformers(cls, tokenizer: Any, eos_token_ids: Iterable[int] = (),
                          add_bos: bool | None = None) -> "HFTokenizer":
        """Wrap a transformers fast tokenizer (its ``backend_tokenizer``, special tokens and
        chat template). Raises TypeError for a slow (Python) tokenizer."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer (no tokenizers backend)")
        return cls(backend, dict(tokenizer.special_tokens_map), getattr(tokenizer, "chat_template", None),
                   eos_token_ids, add_bos, transformers_tokenizer=tokenizer)

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        token_id = None if token is None else self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The chat template's source (settable: a new template for later renders)."""
        return None if self._template is None else self._template.source

    @chat_template.setter
    def chat_template(self, source: str | dict[str, str] | None) -> None:
        self._template = ChatTemplate(source, self.special_tokens) if source else None
        self._turn_tokens = None
        self._renders.clear()
        self._prefix_renders = PrefixRenders()

    @property
    def chat_template_source(self) -> str | None:
        """The chat template's Jinja source (all named templates joined), for format
        detection; None when the tokenizer has none."""
        return None if self._template is None else self._template.text

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` doing the work."""
        return self._backend

    @property
    def turn_tokens(self) -> int:
        """A lower bound on the special tokens the chat template writes per user -> assistant
        turn (:func:`redlite.loading.template_probe.turn_markup_tokens`; probed once per
        template), 0 when unknown."""
        source = self.chat_template_source
        if self._turn_tokens is None or self._turn_tokens[0] != source:
            count = 0
            if source is not None and self._segments.cuts:
                count = turn_markup_tokens(
                    lambda messages: self._render(messages, add_generation_prompt=True),
                    lambda text: self._segments.min_tokens(text, None))
            self._turn_tokens = (source, count)
        return self._turn_tokens[1]

    @property
    def transformers_tokenizer(self) -> Any:
        """A transformers tokenizer of the same files (built on first read: transformers is
        imported only then), e.g. as a reference in tests. None when built from a tokenizer
        object without a directory."""
        if self._transformers is None and self._directory is not None:
            from transformers import PreTrainedTokenizerFast

            self._transformers = PreTrainedTokenizerFast.from_pretrained(str(self._directory))
        return self._transformers

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt; ``bos_token_id`` first only when
        :attr:`add_bos` (and the text does not already start with it). No EOS is added."""
        ids, _ = self._segments.encode(text, offsets=False)
        if self.add_bos and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (ints), special tokens skipped."""
        return self._backend.decode([int(i) for i in token_ids], skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes token ``token_id`` spells; None for a special token or unknown bytes
        (:class:`redlite.loading.token_bytes.TokenBytes`)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self._backend)
        return self._token_bytes(token_id)

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of rendered template text, tokenized as :meth:`render_chat` does (no BOS added)."""
        return self._segments.encode(text, offsets=False)[0]

    def encode_text(self, text: str) -> list[int]:
        """Ids of message text as a chat template's content is tokenized: the text of a special
        token is plain text; no BOS."""
        return self._segments.encode_text(text) if text else []

    def decode_rendered(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens written out (the template's markup)."""
        return self._backend.decode([int(i) for i in token_ids], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], **template_kwargs: Any) -> RenderedPrompt:
        """Render ``messages`` with the chat template (``add_generation_prompt=True``) and
        tokenize the text without adding special tokens (the template writes them). Text of a
        special token inside the messages or ``template_kwargs`` (user content spelling
        ``<|im_start|>system``, say) is tokenized as plain text, never as the special token
        (:mod:`redlite.loading.plain_specials`): only the template's own markup is.

        ``message_ends`` are token counts at which the rendering of ``messages[:i+1]`` ends
        (:func:`redlite.loading.message_bounds.message_boundaries`: a few renders, not one
        per prefix), mapped to token boundaries through the tokenizer's char offsets. A
        boundary that falls inside a token or does not advance is left out, so
        ``message_ends`` may be shorter than ``messages``; they are computed when first read.
        Linear in the conversation's size.
        template_kwargs: passed to the template (e.g. ``enable_thinking=False``, ``tools=``).

        The same input again gives back the same prompt object (a :class:`RenderCache` of
        recent inputs): do not change its lists.

        Raises:
            PromptTooLong: :attr:`prompt_limit` is set (outside
                :func:`redlite.core.tokenizer.no_prompt_limit`) and the rendered text provably has more
                tokens (special tokens counted, the rest bounded by :attr:`max_token_chars`).
            ValueError: the tokenizer has no chat template.
            jinja2 errors raised by the template itself (e.g. ``raise_exception`` calls).
        """
        limit = prompt_limit_of(self)  # a kept render serves both: callers check the exact count
        return self._renders.get_or_render(messages, (template_kwargs, self.prompt_limit),
                                           lambda: self._render_chat(messages, template_kwargs, limit))

    def _render_chat(self, messages: list[dict], template_kwargs: dict,
                     limit: int | None) -> RenderedPrompt:
        protected = self._plain_specials.protect(messages, template_kwargs)
        kwargs = protected.kwargs
        rendered = self._render(protected.messages, add_generation_prompt=True, **kwargs)
        plain: list[tuple[int, int]] = []
        text, at_sentinel, growth = rendered, np.zeros(0, np.int64), np.zeros(0, np.int64)
        if protected.base is not None:
            text, plain, at_sentinel, growth = self._plain_specials.restore(rendered, protected.base)
        if limit is not None:
            at_least = self._segments.over_limit(text, limit, self.max_token_chars)
            if at_least is not None:
                raise PromptTooLong(at_least, limit)
        pieces = None if plain else self._segments.encode_pieces(text, remember=True)
        cut_count = None
        if pieces is not None:  # tokenized from the last cut point shared with a recent prompt
            ids, token_boundary, cut_count = pieces.ids, pieces.token_boundary, pieces.cut_count
        else:
            ids, offsets = self._segments.encode(text, plain)
            token_boundary = offsets_boundary(offsets)

        def render(msgs: list, add_generation_prompt: bool) -> str:
            return self._render(msgs, add_generation_prompt=add_generation_prompt, **kwargs)

        def message_ends() -> list[int]:
            ends: list[int] = []
            extra = input_key(kwargs)
            bounds = message_boundaries(render, protected.messages, rendered,
                                        None if extra is None else (self._prefix_renders, extra))
            for chars in map_positions(bounds, at_sentinel, growth):
                count = token_boundary(chars)
                if count is None or (ends and count <= ends[-1]):  # inside a token, or no advance
                    continue
                ends.append(count)
            return ends

        return RenderedPrompt(token_ids=ids, message_ends=message_ends, text=text, cut_count=cut_count)

    def _render(self, messages: list[dict], add_generation_prompt: bool, **template_kwargs: Any) -> str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def incremental_decoder(self, context_ids: Sequence[int] = ()) -> StreamingDecoder:
        """A fresh :class:`StreamingDecoder`; ``context_ids`` (e.g. the prompt) only give
        the decoder left context and are not emitted."""
        return StreamingDecoder(self._backend, context_ids)


def _max_token_chars(backend: Any) -> int | None:
    """The most characters of input text one token can cover: the longest vocabulary string
    (a byte-level token's string has one character per byte, and a text character is at least
    one byte). None when a normalizer may shorten the text before tokenizing (no bound)."""
    if backend.normalizer is not None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(map(len, vocab), default=0) or None


def load_tokenizer(model_dir: str | os.PathLike[str]) -> HFTokenizer:
    """Load the tokenizer of a Hugging Face model directory (e.g. from
    :func:`redlite.loading.gguf.resolve_model_dir`).

    Reads ``tokenizer.json`` with ``tokenizers`` alone where that is the whole tokenizer
    (:func:`redlite.loading.tokenizer_files.read_plain`: converted GGUFs and plain
    directories), else through transformers (``PreTrainedTokenizerFast`` from
    ``tokenizer.json``, else ``AutoTokenizer``). BOS: see
    :attr:`HFTokenizer.add_bos` (transformers 5 ignores ``add_bos_token`` for a plain
    ``tokenizer.json``, so it is read here). The eos ids gathered:
    ``eos_token_id`` (int or list) of ``generation_config.json`` and ``config.json`` (also
    its ``text_config``), the tokenizer's eos token, and the :data:`END_OF_TURN_TOKENS` in
    the vocabulary.

    Raises:
        FileNotFoundError: ``model_dir`` holds no tokenizer files.
        TypeError: only a slow tokenizer could be loaded.
    """
    directory = Path(model_dir)
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {directory}")
    plain = read_plain(directory)
    tokenizer = None
    if plain is None:
        if (directory / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(directory))

    add_bos: bool | None = None
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        try:
            value = json.loads(config_path.read_text(encoding="utf-8")).get("add_bos_token")
        except (OSError, ValueError, AttributeError):
            value = None
        if isinstance(value, bool):
            add_bos = value

    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            logger.warning("cannot read %s: %s", path, err)
            continue
        for section in (data, data.get("text_config") or {}):
            value = section.get("eos_token_id") if isinstance(section, dict) else None
            if isinstance(value, int):
                eos.append(value)
            elif isinstance(value, list):
                eos.extend(int(v) for v in value if isinstance(v, int))
    if tokenizer is not None:
        return HFTokenizer.from_transformers(tokenizer, eos_token_ids=eos, add_bos=add_bos)
    backend, specials, template, _config = plain
    return HFTokenizer(backend, specials, template, eos, add_bos, directory=directory)
