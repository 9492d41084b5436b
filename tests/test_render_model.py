"""The bundled model's tokenizer: pieces tokenize exactly like the whole text, message_ends
match the one-render-per-prefix definition, and rendering stays linear and thread-friendly."""

import gc
import re
import threading
import time

import pytest

from redlite.loading.bundled import bundled_model_path
from redlite.loading.gguf import resolve_model_dir
from redlite.loading.segment_encoder import SegmentEncoder
from redlite.loading.tokenizer import load_tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_dir(bundled_model_path()))


TEXTS = [
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces<|im_end|>   \n\n<|im_start|>  x<|im_start|><|im_end|>",
    "Grüße 😀 中文<|endoftext|>def f(x):\n    return x  # <|im_end|>tail",
    "no special tokens at all, just text   with   spaces\n\n\n",
    "<|im_end|><|im_end|>\n<|im_start|>system\n" + "word " * 500,
]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_tokenize_exactly_like_the_whole_text(tok, text):
    encoder = SegmentEncoder(tok._backend)
    assert encoder.cuts  # SmolLM2: byte-level BPE, no normalizer
    whole = tok._backend.encode(text, add_special_tokens=False)
    for _ in range(2):  # cold, then from the cache
        ids, offsets = encoder.encode(text)
        assert ids == whole.ids
        assert [tuple(o) for o in offsets.tolist()] == [tuple(o) for o in whole.offsets]


def conversation(n):
    return [{"role": "system", "content": "be brief"}] + [
        {"role": ("user", "assistant")[i % 2], "content": f"message {i} " + "x" * (i % 7)} for i in range(n)]


def test_message_ends_equal_one_render_per_prefix(tok):
    hf = tok.transformers_tokenizer
    messages = conversation(9)
    rendered = tok.render_chat(messages)
    expected = []
    for i in range(len(messages)):
        prefix = hf.apply_chat_template(messages[: i + 1], add_generation_prompt=False, tokenize=False)
        expected.append(len(tok.encode(prefix)))
    assert rendered.message_ends == expected
    assert rendered.token_ids == tok._backend.encode(rendered.text, add_special_tokens=False).ids


def test_render_is_linear_in_the_message_count(tok):
    def cost(n):
        messages = conversation(n)
        started = time.perf_counter()
        rendered = tok.render_chat(messages)
        assert len(rendered.message_ends) == len(messages)
        return time.perf_counter() - started
    cost(200)
    gc.collect()
    gc.disable()  # a gen-2 collection of the whole suite's heap inside one timing is not rendering
    try:
        small, large = min(cost(400) for _ in range(2)), min(cost(4000) for _ in range(2))
    finally:
        gc.enable()
    # quadratic work (one render per prefix) would cost ~100x for 10x the messages
    assert large < 30 * small, (small, large)


def test_a_long_render_does_not_stall_other_threads(tok):
    messages = conversation(6000)
    gaps = []
    worker = threading.Thread(target=lambda: tok.render_chat(messages).message_ends)
    gc.collect()
    gc.disable()  # a collection stops every thread whoever holds the GIL: not what this measures
    try:
        started = last = time.perf_counter()
        worker.start()
        while worker.is_alive():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    finally:
        gc.enable()
    # tokenizing runs without the GIL and rendering yields it every switch interval (a
    # GIL-holding encode stalled this thread for most of the work)
    assert max(gaps) < 0.25 * (last - started), (max(gaps), last - started)


def test_the_template_probe_bounds_every_turn(tok):
    from redlite.core.tokenizer import min_chat_tokens

    assert tok.turn_tokens == 4  # ChatML: <|im_start|> and <|im_end|> around both messages
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for messages in (conversation(1), conversation(40), conversation(41)[1:],
                     [{"role": "user", "content": "a"}] * 5 + [{"role": "assistant", "content": "b"}] * 5):
        rendered = tok.render_chat(messages)
        assert 0 < min_chat_tokens(messages, tok) <= len(rendered.token_ids)
        assert min_chat_tokens(messages, tok) <= len(tok.render_chat(messages, tools=tools).token_ids)


def test_ten_thousand_messages_are_refused_without_rendering(tok, monkeypatch):
    from redlite.core.chat import ChatRequest
    from redlite.server.chat_service import ChatService
    from redlite.server.errors import APIError

    service = ChatService(worker=None, tokenizer=tok, max_context=8192)
    tok.turn_tokens  # probed once, at load in the server
    renders = []
    real = tok._render
    monkeypatch.setattr(tok, "_render", lambda *a, **k: renders.append(1) or real(*a, **k))
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"} for i in range(10_000)]
    started = time.process_time()
    with pytest.raises(APIError) as refused:
        service.prepare_sync(ChatRequest(messages=messages + [{"role": "user", "content": "hi"}]))
    assert refused.value.status == 400 and refused.value.param == "messages"
    at_least = int(re.match(r"prompt is too long: (\d+) tokens > 8192 maximum \(at least",
                            refused.value.message).group(1))
    assert 20_000 < at_least < 10_000 * 10  # 5,000 turns x 4 special tokens, plus the text
    assert renders == [] and time.process_time() - started < 0.2
    # one that fits is still rendered
    service.prepare_sync(ChatRequest(messages=messages[:100] + [{"role": "user", "content": "hi"}]))
    assert renders


@pytest.mark.parametrize("template, per_turn", [("qwen3_tools.jinja", 4), ("llama3_tools.jinja", 0)])
def test_the_probe_reads_each_template(template, per_turn):
    """Qwen3's template is ChatML; Llama 3's markup is plain text in this vocabulary (no
    special tokens to count: no bound, never a wrong one)."""
    from pathlib import Path

    tokenizer = load_tokenizer(resolve_model_dir(bundled_model_path()))
    tokenizer.chat_template = (Path(__file__).parent / "templates" / template).read_text()
    assert tokenizer.turn_tokens == per_turn
