"""A model's chat template (Jinja), rendered the way Hugging Face chat templates are specified,
with ``jinja2`` alone: importing transformers and building its tokenizer cost ~1 s and ~50 MB
of a CPU server's start-up (bench/results/cpu-*-notes.md), for this one function.

The conventions a chat template is written against (Hugging Face's chat-templating docs):
a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks`` and the loop controls
(``break``/``continue``); ``tojson`` without HTML escaping (``ensure_ascii``, ``indent``,
``separators``, ``sort_keys`` accepted); the globals ``raise_exception(message)`` and
``strftime_now(format)``; the ``{% generation %}`` block (rendered as its body); the variables
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's named special
tokens (``bos_token``, ``eos_token``, ...) and the caller's keyword arguments (which win); a
message's reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` is visible
under the first two names too. Named templates (a dict): ``tool_use`` when tools are given and
it exists, else ``default``. tests/test_chat_template.py checks the output equals
transformers' ``apply_chat_template`` on the bundled and test templates.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

#: Names a message's reasoning may come under; the first two are filled from any of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """One chat template. ``source``: the Jinja text, or ``{name: text}`` of named templates;
    ``special_tokens``: ``{"bos_token": "<s>", ...}`` passed to the template. Raises
    ``jinja2.TemplateSyntaxError`` for a template that does not compile (at first render)."""

    def __init__(self, source: str | dict[str, str], special_tokens: dict[str, str] | None = None):
        if not isinstance(source, (str, dict)):
            raise TypeError(f"a chat template is a string or a dict of them, not {type(source).__name__}")
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @property
    def text(self) -> str:
        """All the template's Jinja source (named templates joined), for format detection."""
        return "\n".join(str(t) for t in self.source.values()) if isinstance(self.source, dict) else self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None,
               documents: list | None = None, **kwargs: Any) -> str:
        """The template's text for ``messages`` (dicts, left unchanged). Raises
        ``jinja2.TemplateError`` (``raise_exception`` in the template among others) and
        ``ValueError`` when a named template set has no template for the call."""
        chat = [_alias_reasoning(m) if isinstance(m, dict) else m for m in messages]
        variables = {**self.special_tokens, **kwargs}
        return _compiled(self._pick(tools)).render(messages=chat, tools=tools, documents=documents,
                                                    add_generation_prompt=add_generation_prompt, **variables)

    def _pick(self, tools: list | None) -> str:
        if isinstance(self.source, str):
            return self.source
        if tools is not None and "tool_use" in self.source:
            return self.source["tool_use"]
        if "default" not in self.source:
            raise ValueError(f"no 'default' chat template among {sorted(self.source)}")
        return self.source["default"]


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the body, as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
