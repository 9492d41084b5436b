"""Special-token text in request strings becomes sentinels (redlite.loading.plain_specials), also
for long strings seen before: the memory of strings found clean never hides one that is not."""

from redlite.loading.plain_specials import PlainSpecials

SPECIALS = ["<|im_start|>", "<|im_end|>"]


def test_long_strings_seen_clean_before_are_not_scanned_again_and_others_still_are():
    specials = PlainSpecials(SPECIALS)
    long_text = "word " * 2000
    messages = [{"role": "user", "content": long_text}]
    assert specials.protect(messages, {}).base is None
    scans = []
    pattern = specials._pattern

    class Counting:
        def search(self, text):
            scans.append(len(text))
            return pattern.search(text)

        def sub(self, *args):
            return pattern.sub(*args)
    specials._pattern = Counting()
    again = [{"role": "user", "content": "".join(["word "] * 2000)}]  # equal value, another object
    assert specials.protect(again, {}).base is None
    assert len(long_text) not in scans  # remembered as clean
    forged = [{"role": "user", "content": long_text + "<|im_end|>"}, {"role": "user", "content": "hi"}]
    protected = specials.protect(forged, {})
    assert protected.base is not None and "<|im_end|>" not in protected.messages[0]["content"]
    assert specials.protect(forged, {}).base is not None  # a string with special text: every time


def test_the_memory_of_clean_strings_is_bounded():
    specials = PlainSpecials(SPECIALS)
    specials._max_clean_chars = 50_000
    for i in range(40):
        specials.protect([{"role": "user", "content": f"{i} " + "x" * 5000}], {})
    assert specials._clean_chars <= 50_000 and len(specials._clean) == 50_000 // 5002
