"""The chat template rendered without transformers (redlite.loading.chat_template) equals
transformers' apply_chat_template, and the bundled model's tokenizer loads without importing
transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "Ünïcode <b>"}},
                                               "required": ["city"]}}}]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello 😀"}, {"role": "user", "content": "and now?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "reasoning_content": "look it up",
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "21 degrees", "reasoning": "from the tool"}],
]


@pytest.fixture(scope="module")
def tokenizers_pair():
    from redlite.loading.bundled import bundled_model_path
    from redlite.loading.gguf import resolve_model_dir
    from redlite.loading.tokenizer import load_tokenizer

    ours = load_tokenizer(resolve_model_dir(bundled_model_path()))
    return ours, ours.transformers_tokenizer


@pytest.mark.parametrize("template", [None, "qwen3_tools.jinja", "llama3_tools.jinja"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_render_equals_transformers(tokenizers_pair, template, chat, tools, generation_prompt):
    from redlite.loading.chat_template import ChatTemplate

    ours, hf = tokenizers_pair
    source = (TEMPLATES / template).read_text() if template else hf.chat_template
    messages = json.loads(json.dumps(CHATS[chat]))
    kwargs = {"enable_thinking": False} if template == "qwen3_tools.jinja" else {}
    mine = ChatTemplate(source, ours.special_tokens).render(messages, add_generation_prompt=generation_prompt,
                                                            tools=tools, **kwargs)
    theirs = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False,
                                    chat_template=source, **kwargs)
    assert mine == theirs
    assert messages == CHATS[chat]  # the caller's messages are not edited


def test_raise_exception_and_named_templates(tokenizers_pair):
    import jinja2

    from redlite.loading.chat_template import ChatTemplate

    ours, _ = tokenizers_pair
    with pytest.raises(jinja2.TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])
    named = ChatTemplate({"default": "D{{ bos_token }}", "tool_use": "T"}, ours.special_tokens)
    assert named.render([]) == "D<|im_start|>" and named.render([], tools=TOOLS) == "T"
    with pytest.raises(ValueError, match="default"):
        ChatTemplate({"tool_use": "T"}).render([])
    assert ChatTemplate("{% generation %}{{ 1 + 1 }}{% endgeneration %}").render([]) == "2"


def test_bundled_tokenizer_loads_without_transformers():
    code = ("import sys\n"
            "from redlite.loading.bundled import bundled_model_path\n"
            "from redlite.loading.gguf import resolve_model_dir\n"
            "from redlite.loading.tokenizer import load_tokenizer\n"
            "tok = load_tokenizer(resolve_model_dir(bundled_model_path()))\n"
            "tok.render_chat([{'role': 'user', 'content': 'hi'}])\n"
            "print('transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_other_tokenizer_classes_go_through_transformers(tmp_path, tokenizers_pair):
    from redlite.loading.tokenizer_files import read_plain

    ours, _ = tokenizers_pair
    (tmp_path / "tokenizer.json").write_text(ours.backend_tokenizer.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))
    assert read_plain(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<not in vocab>"}))
    assert read_plain(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": "x"}))
    backend, specials, template, _ = read_plain(tmp_path)
    assert specials == {"eos_token": "<|im_end|>"} and template == "x"
