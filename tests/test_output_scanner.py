"""The streaming output scanner: reasoning and tool-call formats and every failure class of the
issue "Agents can drive redlite" (inputs written by us). Every case is fed in one piece, char by
char and in random splits: the outputs must agree, the streamed pieces must concatenate to the
final output, and every reported call's arguments must be a JSON object."""

from __future__ import annotations

import itertools
import json
import random



from redlite.core.output_scanner import OutputScanner, ParseOptions



HERMES = ParseOptions(tool_format="hermes", reasoning="qwen3")
SCHEMAS = {"write": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "count": {"type": "integer"},
    "ratio": {"type": "number"}, "force": {"type": "boolean"}, "tags": {"type": "array"},
    "meta": {"type": "object"}}}}
CODER = ParseOptions(tool_format="qwen3_coder", reasoning="qwen3", schemas=SCHEMAS)
LLAMA = ParseOptions(tool_format="llama3_json")


def scan(text, sizes, options, stops=(), reason="stop"):
    counter = itertools.count()
    scanner = OutputScanner(list(stops), options, lambda: f"call_{next(counter)}")
    events, position = [], 0
    for size in sizes:
        new, stopped = scanner.push(text[position:position + size])
        events += new
        position += size
        if stopped:
            break
    new, output = scanner.finish(reason)
    return events + new, output


def check(text, options, stops=(), reason="stop", all_calls_valid=True):
    """The output of ``text``, after checking every chunking against the one-piece result.
    all_calls_valid: every streamed call is in the output (False: a malformed call may have
    been streamed and dropped; the calls kept must still equal their streamed pieces)."""
    _, whole = scan(text, [len(text)], options, stops, reason)
    rng = random.Random(len(text))
    chunkings = [[1] * len(text)] + [[rng.randint(1, 9) for _ in text] for _ in range(25)]
    for sizes in chunkings:
        events, output = scan(text, sizes, options, stops, reason)
        assert output == whole
        for kind, field in (("content", "content"), ("reasoning", "reasoning")):
            assert "".join(e.value for e in events if e.kind == kind) == getattr(output, field)
        if reason != "length":
            streamed = {}
            for e in events:
                if e.kind == "tool_call":
                    d = e.value
                    if d.name is not None:
                        streamed[d.index] = [d.id, d.name, d.arguments]
                    else:
                        streamed[d.index][2] += d.arguments
            kept = [(c.id, c.name, c.arguments) for c in output.tool_calls]
            if all_calls_valid:
                assert [tuple(v) for v in streamed.values()] == kept
            else:
                assert all(tuple(streamed[int(i.removeprefix("call_"))]) == (i, n, a) for i, n, a in kept)
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    return whole


def calls(output):
    return [(c.name, json.loads(c.arguments)) for c in output.tool_calls]


# --- hermes ---------------------------------------------------------------------------------------

def test_hermes_text_before_two_calls_and_reasoning():
    out = check('<think>\nPlan it.\n</think>\n\nSure, two calls.\n\n<tool_call>\n'
                '{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "read", "arguments": {"path": "b.py", "n": [1, {"x": null}]}}\n</tool_call>',
                HERMES)
    assert out.reasoning == "Plan it."
    assert out.content == "Sure, two calls."
    assert calls(out) == [("read", {"path": "a.py"}), ("read", {"path": "b.py", "n": [1, {"x": None}]})]
    assert out.finish_reason == "tool_calls"


def test_hermes_closing_tag_inside_a_string_value():
    text = '<tool_call>\n{"name": "write", "arguments": {"content": "x </tool_call> y \\" }"}}\n</tool_call>'
    out = check(text, HERMES)
    assert calls(out) == [("write", {"content": 'x </tool_call> y " }'})]


def test_hermes_arguments_stream_in_pieces_name_first():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "' + "long text " * 20 + '"}}\n</tool_call>'
    events, out = scan(text, [5] * (len(text) // 5 + 1), HERMES)
    pieces = [e.value for e in events if e.kind == "tool_call"]
    assert pieces[0].name == "f" and pieces[0].arguments == ""
    assert len(pieces) > 10  # arguments arrive as they are generated, not at the end
    assert "".join(p.arguments for p in pieces) == out.tool_calls[0].arguments


def test_hermes_truncated_call_is_not_reported():
    out = check('Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.', HERMES,
                reason="length")
    assert out.tool_calls == [] and out.finish_reason == "length" and out.content == "Let me look."


def test_hermes_malformed_body_stays_text():
    out = check("<tool_call>\nnot json at all\n</tool_call> done", HERMES)
    assert out.tool_calls == [] and out.content == "<tool_call>\nnot json at all\n</tool_call> done"


def test_hermes_arguments_given_as_a_json_string():
    out = check('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', HERMES)
    assert calls(out) == [("f", {"a": 1})]


def test_hermes_missing_closing_tag_at_end_of_output():
    out = check('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', HERMES)
    assert calls(out) == [("f", {"a": 1})]


# --- reasoning ------------------------------------------------------------------------------------

def test_reasoning_opened_in_the_prompt():
    opts = ParseOptions(tool_format="hermes", reasoning="qwen3", start_in_reasoning=True)
    out = check("\nI should answer.\n</think>\n\nThe answer.", opts)
    assert (out.reasoning, out.content) == ("I should answer.", "The answer.")


def test_call_inside_reasoning_ends_the_reasoning():
    opts = ParseOptions(tool_format="hermes", reasoning="qwen3", start_in_reasoning=True)
    out = check('Need a file.\n<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call>', opts)
    assert out.reasoning == "Need a file." and calls(out) == [("read", {})]


def test_think_later_in_the_answer_is_text():
    out = check("Use <think> tags like <think>x</think>.", HERMES)
    assert out.reasoning == "" and out.content == "Use <think> tags like <think>x</think>."


def test_no_parsers_pass_text_unchanged():
    text = "  <think>a</think> <tool_call>{}</tool_call>\n\n"
    assert check(text, ParseOptions()).content == text


# --- qwen3_coder ----------------------------------------------------------------------------------

def coder_call(*params, function="write"):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


def test_coder_types_from_schema_and_newlines_are_markup():
    text = "Writing.\n" + coder_call(("path", "a.txt"), ("count", "3"), ("ratio", "0.5"),
                                     ("force", "true"), ("tags", '["x", "y"]'),
                                     ("meta", '{"k": 1}'), ("content", "\nline 1\nline 2\n"))
    out = check(text, CODER)
    assert out.content == "Writing."
    assert calls(out) == [("write", {"path": "a.txt", "count": 3, "ratio": 0.5, "force": True,
                                     "tags": ["x", "y"], "meta": {"k": 1},
                                     "content": "\nline 1\nline 2\n"})]


def test_coder_literal_closing_tags_inside_a_value():
    content = "a </parameter> b\n</tool_call>\nc </function> d"
    out = check(coder_call(("content", content), ("path", "p")), CODER)
    assert calls(out) == [("write", {"content": content, "path": "p"})]


def test_coder_missing_final_parameter_close():
    text = "<tool_call>\n<function=write>\n<parameter=path>\nx.py\n</function>\n</tool_call>"
    assert calls(check(text, CODER)) == [("write", {"path": "x.py"})]


def test_coder_two_calls_and_bare_function():
    text = coder_call(("path", "a")) + "\n<function=write>\n<parameter=path>\nb\n</parameter>\n</function>"
    assert calls(check(text, CODER)) == [("write", {"path": "a"}), ("write", {"path": "b"})]


def test_coder_malformed_parameter_name_is_dropped():
    text = ("<tool_call>\n<function=write>\n<parameter=pa<th>\nv\n</parameter>\n"
            "<parameter=path>\nok\n</parameter>\n</function>\n</tool_call>")
    assert calls(check(text, CODER)) == [("write", {"path": "ok"})]


def test_coder_unknown_parameter_and_bad_number_stay_strings():
    text = coder_call(("other", "12"), ("count", "many"))
    assert calls(check(text, CODER)) == [("write", {"other": "12", "count": "many"})]


def test_coder_truncated_call_is_not_reported():
    out = check("<tool_call>\n<function=write>\n<parameter=content>\nhalf a fi", CODER, reason="length")
    assert out.tool_calls == [] and out.finish_reason == "length"


def test_coder_string_value_streams_as_generated():
    text = coder_call(("content", "word " * 40))
    events, out = scan(text, [7] * (len(text) // 7 + 1), CODER)
    assert sum(e.kind == "tool_call" for e in events) > 15
    assert calls(out)[0][1]["content"] == "word " * 40


# --- llama3_json ----------------------------------------------------------------------------------

def test_llama3_json_call_and_plain_json_answer():
    out = check('{"name": "get_weather", "parameters": {"city": "Paris"}}', LLAMA)
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    out = check('{"name": "Bob", "age": 3}', LLAMA)
    assert out.tool_calls == [] and out.content == '{"name": "Bob", "age": 3}'


# --- stops and forced openings --------------------------------------------------------------------

def test_stop_sequence_cuts_before_markers():
    out = check("abc STOP <tool_call>\n", HERMES, stops=["STOP"])
    assert out.content == "abc " and out.stop_sequence == "STOP" and out.finish_reason == "stop"


def test_one_call_when_parallel_calls_are_off():
    opts = ParseOptions(tool_format="hermes", max_calls=1)
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    for sizes in ([len(text)], [1] * len(text)):
        counter = itertools.count()
        scanner = OutputScanner([], opts, lambda: f"call_{next(counter)}")
        events, position, stopped = [], 0, False
        for size in sizes:
            new, stopped = scanner.push(text[position:position + size])
            events += new
            position += size
            if stopped:
                break
        assert stopped
        _, out = scanner.finish("stop")
        assert calls(out) == [("a", {})] and out.finish_reason == "tool_calls"
        assert all(e.value.index == 0 for e in events if e.kind == "tool_call")


def test_call_cut_before_its_name_is_neither_call_nor_text():
    out = check('Text.\n<tool_call>\n{"na', HERMES, reason="length")
    assert (out.content, out.tool_calls, out.finish_reason) == ("Text.", [], "length")


def test_random_markup_soup_keeps_every_invariant():
    """Texts made of markup fragments in random order: no exception, every chunking gives the
    same output, pieces concatenate to it, arguments are JSON objects."""
    pieces = ["<tool_call>", "</tool_call>", "<function=write>", "<parameter=path>",
              "<parameter=count>", "</parameter>", "</function>", "<think>", "</think>", "{",
              "}", '"', "\\", "\n", " ", "x", "<", "</", '{"name": "f", "arguments": {', '"a": 1',
              '{"name": "f", "parameters": {"b": [2]}}', "STOP"]
    rng = random.Random(7)
    for _ in range(80):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        for options in (HERMES, CODER, LLAMA, ParseOptions(tool_format="hermes", reasoning="qwen3",
                                                            start_in_reasoning=True)):
            for reason in ("stop", "length"):
                check(text, options, stops=["STOP"], reason=reason, all_calls_valid=False)


def test_a_call_repeating_an_earlier_one_ends_the_answer():
    """A model in a loop: the answer ends at the first exact repeat (kept as generated, so
    every chunking and the streamed pieces agree); different arguments are no repeat."""
    a = '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>'
    b = a.replace("a.py", "b.py")
    out = check("\n".join([a, b, a, a, a]) + "\nmore text", HERMES)
    assert calls(out) == [("read", {"path": "a.py"}), ("read", {"path": "b.py"}),
                          ("read", {"path": "a.py"})]
    assert out.finish_reason == "tool_calls" and out.content == ""
    coder = coder_call(("path", "x"))
    assert calls(check("\n".join([coder] * 5), CODER)) == [("write", {"path": "x"})] * 2


def test_dropped_calls_are_counted():
    """Calls whose text the answer does not report (what exact replay must not keep)."""
    whole = '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>'
    assert check(whole, HERMES).dropped_calls == 0
    assert check(whole[:-20], HERMES, reason="length").dropped_calls == 1  # cut by max_tokens
    assert check('Text.\n<tool_call>\n{"na', HERMES, reason="length").dropped_calls == 1
    assert check("<tool_call>\n<function=write>\n<parameter=content>\nhalf", CODER,
                 reason="length").dropped_calls == 1
    broken = '<tool_call>\n{"name": "read", "arguments": {"path": a.py}}\n</tool_call>'
    assert check(broken + "\n" + whole, HERMES, all_calls_valid=False).dropped_calls == 1
    assert check("<tool_call>\nnot json at all\n</tool_call> done", HERMES).dropped_calls == 0  # text


def test_a_body_that_is_no_call_keeps_the_whitespace_before_its_opener():
    """Whitespace before ``<tool_call>`` is markup only when a call follows: text that merely
    mentions the tag lost it ("See<tool_call>..." for "See <tool_call>...")."""
    for text in ("See <tool_call>not json</tool_call> here", 'hi\n<tool_call>\n{"x": 1}\n</tool_call>\nbye',
                 "<think>\nhm\n</think>\n\nUse the <tool_call> tag."):
        assert check(text, HERMES).content == text.split("</think>\n\n")[-1]
    assert check("hi <tool_call>", HERMES).content == "hi <tool_call>"
    out = check('hi \n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', HERMES)
    assert out.content == "hi" and calls(out) == [("f", {})]
    out = check("<think>\nI could write <tool_call> here\n</think>\n\nok", HERMES)
    assert out.reasoning == "I could write" and out.content.startswith("<tool_call>")
