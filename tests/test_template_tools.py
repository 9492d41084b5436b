"""A chat template that never reads ``tools`` (the bundled SmolLM2's) leaves tool definitions
out of the prompt: the server says so at start-up."""

from __future__ import annotations

import logging
from pathlib import Path

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.chat_render import template_renders_tools
from redlite.server.chat_service import ChatService

TEMPLATES = Path(__file__).parent / "templates"
NO_TOOLS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{{ message['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class TemplateOnly:
    """The one tokenizer attribute ChatService reads at construction."""

    def __init__(self, source: str) -> None:
        self.chat_template_source = source


def test_template_renders_tools():
    assert template_renders_tools((TEMPLATES / "qwen3_tools.jinja").read_text())
    assert template_renders_tools((TEMPLATES / "llama3_tools.jinja").read_text())
    assert not template_renders_tools(NO_TOOLS)
    assert not template_renders_tools("{{ mytools_count }}")  # a word, not the variable
    assert template_renders_tools(None)  # unknown: no warning


def warnings_of(caplog, tokenizer) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="redlite.chat"):
        ChatService(worker=None, tokenizer=tokenizer, max_context=256)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_start_up_warns_when_tools_are_not_rendered(caplog):
    assert any("does not render tools" in m for m in warnings_of(caplog, TemplateOnly(NO_TOOLS)))
    source = (TEMPLATES / "qwen3_tools.jinja").read_text()
    assert warnings_of(caplog, TemplateOnly(source)) == []
    assert warnings_of(caplog, ByteTokenizer()) == []
