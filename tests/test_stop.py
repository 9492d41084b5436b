"""Tests for redlite.core.stop: the OpenAI ``stop`` field and the streaming stop scanner."""

from __future__ import annotations

import random

import pytest

from redlite.core.stop import MAX_STOP_BYTES, StopScanner, normalize_stop


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """Push all pieces (flushing if no stop) and return the emitted pieces and stopped."""
    sc = StopScanner(stops)
    out = []
    stopped = False
    for p in pieces:
        emit, stopped = sc.push(p)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(sc.flush())
        stopped = sc.stopped
    return out, stopped


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    """Non-incremental rule: cut the whole text at the earliest start of any stop string."""
    starts = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not starts:
        return text, False
    return text[: min(starts)], True


# --- the scanner ----------------------------------------------------------------------------


def test_stop_split_across_pushes():
    sc = StopScanner(["lo W"])
    assert sc.push("Hel") == ("He", False)  # "l" could start "lo W"
    assert sc.push("lo W") == ("l", True)  # "l" + "lo W": the first "l" is released
    assert sc.push("orld") == ("", True)
    assert sc.matched == "lo W"
    assert sc.flush() == ""


def test_stop_split_three_ways():
    out, stopped = run(["lo W"], ["Hel", "lo", " ", "World"])
    assert "".join(out) == "Hel" and stopped


def test_no_stops_passes_through():
    sc = StopScanner([])
    assert sc.push("abc") == ("abc", False)
    assert sc.push("") == ("", False)
    assert sc.flush() == ""
    assert not sc.stopped


def test_text_without_stop_chars_is_sent_at_once():
    sc = StopScanner(["END"])
    assert sc.push("hello ") == ("hello ", False)
    assert sc.push("world") == ("world", False)
    assert sc.flush() == ""


def test_earliest_match_wins_among_several():
    # "bb" occurs at 4, "aa" at 1: the earlier one wins even though "bb" is listed first.
    out, stopped = run(["bb", "aa"], ["xaa", "yb", "b"])
    assert "".join(out) == "x" and stopped


def test_later_listed_but_earlier_starting_completes_later():
    # "bc" completes first (at "abc"), but "abcd" starts earlier and completes afterwards.
    sc = StopScanner(["bc", "abcd"])
    assert sc.push("xabc") == ("x", False)  # "bc" found at 2, but "abcd" open from 1
    assert sc.push("d!") == ("", True)
    assert sc.matched == "abcd"


def test_earlier_partial_fails_then_later_complete_match_applies():
    sc = StopScanner(["abcd", "bc"])
    assert sc.push("xabc") == ("x", False)
    assert sc.push("e") == ("a", True)  # "abcd" failed; "bc" at 2 stands
    assert sc.matched == "bc"


def test_overlapping_stops():
    # "aba" and "bab" overlap in "ababab": "aba" starts at 0.
    out, stopped = run(["bab", "aba"], ["a", "b", "a", "b"])
    assert "".join(out) == "" and stopped
    out, stopped = run(["bab", "aba"], ["zb", "a", "b"])
    assert "".join(out) == "z" and stopped


def test_one_stop_prefix_of_another_same_start_shortest_reported():
    sc = StopScanner(["abc", "ab"])
    assert sc.push("xa") == ("x", False)
    assert sc.push("b") == ("", True)  # decided at once; no waiting for "c"
    assert sc.matched == "ab"


def test_stop_that_is_prefix_of_a_later_match():
    # "ab" is a prefix of "abc"; "b" matches inside it but starts later.
    out, stopped = run(["b", "abc"], ["1a", "bc2"])
    assert "".join(out) == "1" and stopped


def test_self_overlapping_stop_kmp_fallback():
    # "aab" in "aaab": the partial "aa" must fall back, not restart.
    out, stopped = run(["aab"], ["a", "a", "a", "b", "tail"])
    assert "".join(out) == "a" and stopped


@pytest.mark.parametrize(
    "stops, pieces, expected",
    [
        (["。"], ["你好", "。", "再见"], "你好"),
        (["。"], ["你好。再见"], "你好"),
        (["🙂"], ["ok ", "🙂", " more"], "ok "),
        (["ü"], ["gr", "üße"], "gr"),
        (["über。"], ["x ü", "ber", "。y"], "x "),
        (["🙂🙂"], ["a🙂", "🙂b"], "a"),
        (["u\u0308"], ["mu", "\u0308de"], "m"),  # decomposed ü split between pieces
    ],
)
def test_multibyte_stops_split_across_pushes(stops, pieces, expected):
    out, stopped = run(stops, pieces)
    assert "".join(out) == expected and stopped


def test_multibyte_partial_is_held_then_flushed():
    sc = StopScanner(["über。"])
    assert sc.push("x üb") == ("x ", False)
    assert sc.pending == "üb"
    assert sc.flush() == "üb"
    assert not sc.stopped


def test_precomposed_does_not_match_decomposed():
    out, stopped = run(["ü"], ["mu\u0308de"])
    assert "".join(out) == "mu\u0308de" and not stopped


def test_held_back_partial_is_flushed_at_end():
    sc = StopScanner(["###"])
    assert sc.push("answer #") == ("answer ", False)
    assert sc.push("#") == ("", False)
    assert sc.flush() == "##"
    assert not sc.stopped
    assert sc.flush() == ""


def test_partial_that_does_not_match_is_released():
    sc = StopScanner(["STOP"])
    assert sc.push("ST") == ("", False)
    assert sc.push("O") == ("", False)
    assert sc.push("P!") == ("", True)
    sc = StopScanner(["STOP"])
    assert sc.push("ST") == ("", False)
    assert sc.push("OR") == ("STOR", False)
    assert sc.push("Y") == ("Y", False)


def test_released_partial_keeps_a_new_partial_inside_it():
    sc = StopScanner(["abab"])
    assert sc.push("aba") == ("", False)
    assert sc.push("a") == ("aba", False)  # "abaa": only the last "a" may still start "abab"
    assert sc.pending == "a"


def test_stop_at_first_piece_gives_empty_output():
    sc = StopScanner(["<|end|>"])
    assert sc.push("<|end|>and more") == ("", True)
    assert sc.stopped and sc.matched == "<|end|>"
    assert sc.flush() == ""


def test_text_after_stop_is_dropped():
    sc = StopScanner(["\n\n"])
    assert sc.push("line one\n\nline two") == ("line one", True)
    assert sc.push("line three") == ("", True)
    assert sc.push("") == ("", True)
    assert sc.flush() == ""


def test_flush_cuts_at_complete_match_behind_open_partial():
    # "bc" matched, but "abcd" (earlier start) was still open when generation ended.
    sc = StopScanner(["abcd", "bc"])
    assert sc.push("zabc") == ("z", False)
    assert sc.flush() == "a"
    assert sc.stopped and sc.matched == "bc"


def test_push_after_flush_raises():
    sc = StopScanner(["x"])
    sc.flush()
    with pytest.raises(RuntimeError):
        sc.push("a")


def test_empty_stop_rejected_by_scanner():
    with pytest.raises(ValueError):
        StopScanner(["ok", ""])


def test_pending_stays_bounded():
    stops = ["a" * 50 + "b", "xyz"]
    sc = StopScanner(stops)
    longest = max(map(len, stops))
    total = []
    for _ in range(2000):
        emit, stopped = sc.push("a")
        assert not stopped
        total.append(emit)
        assert len(sc.pending) < longest
    total.append(sc.flush())
    assert "".join(total) == "a" * 2000


# --- property-style: incremental == non-incremental ----------------------------------------


ALPHABET = ["a", "b", "c", "ü", "。", "🙂", " "]


def _random_case(rng: random.Random) -> tuple[list[str], str, list[str]]:
    nstops = rng.randint(1, 4)
    stops = ["".join(rng.choices(ALPHABET[:4] + ALPHABET[4:], k=rng.randint(1, 5)))
             for _ in range(nstops)]
    if rng.random() < 0.5:
        # Plant a stop, sometimes preceded by a prefix of another, to make matches likely.
        a, b = rng.choice(stops), rng.choice(stops)
        mid = b[: rng.randint(0, len(b))] + a
    else:
        mid = ""
    text = (
        "".join(rng.choices(ALPHABET, k=rng.randint(0, 30)))
        + mid
        + "".join(rng.choices(ALPHABET, k=rng.randint(0, 30)))
    )
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 10))))
    bounds = [0, *cuts, len(text)]
    pieces = [text[i:j] for i, j in zip(bounds, bounds[1:])]
    return stops, text, pieces


def test_random_splits_match_reference():
    rng = random.Random(1234)
    n_stopped = n_plain = 0
    for _ in range(5000):
        stops, text, pieces = _random_case(rng)
        out, stopped = run(stops, pieces)
        want, want_stopped = reference(stops, text)
        assert "".join(out) == want, (stops, pieces)
        assert stopped == want_stopped, (stops, pieces)
        n_stopped += stopped
        n_plain += not stopped
    assert n_stopped > 500 and n_plain > 500  # both branches well exercised


def test_random_one_char_pieces_match_reference():
    rng = random.Random(99)
    for _ in range(2000):
        stops, text, _ = _random_case(rng)
        out, stopped = run(stops, list(text))
        assert ("".join(out), stopped) == reference(stops, text), (stops, text)


# --- normalize_stop --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, []),
        ("###", ["###"]),
        ([], []),
        (["a", "b", "c", "d"], ["a", "b", "c", "d"]),
        (["\n\n", "。"], ["\n\n", "。"]),
        ("x" * MAX_STOP_BYTES, ["x" * MAX_STOP_BYTES]),
        (["🙂" * 64], ["🙂" * 64]),  # 4 bytes each: exactly 256 bytes
    ],
)
def test_normalize_stop_valid(value, expected):
    assert normalize_stop(value) == expected


@pytest.mark.parametrize(
    "value, fragment",
    [
        (["a", "b", "c", "d", "e"], "at most 4"),
        ("", "must not be empty"),
        (["ok", ""], "stop[1]"),
        ("x" * 257, "257 bytes"),
        (["ü" * 129], "258 bytes"),  # 129 characters, 258 bytes
        (["🙂" * 64 + "a"], "257 bytes"),
        (5, "number"),
        (1.5, "number"),
        (True, "boolean"),
        ({"stop": "x"}, "object"),
        (["ok", 3], "stop[1]' must be a string"),
        ([None], "null"),
        ([["nested"]], "array"),
        (("a", "b"), "array"),
    ],
)
def test_normalize_stop_invalid(value, fragment):
    with pytest.raises(ValueError) as exc:
        normalize_stop(value)
    assert fragment in str(exc.value)
