"""Slot placement (redlite.core.placement.choose_slot): ties among slots that lose anyway."""

import pytest

from redlite.core.placement import SlotView, choose_slot

pytestmark = pytest.mark.timeout(10)


def test_a_regenerate_of_a_long_answer_rewinds_its_own_slot_not_an_unrelated_one():
    prompt = [1, 2, 3, 4]
    # the same prompt answered at length (the prompt is under half of what the slot holds)
    own = SlotView(0, prompt + list(range(10, 20)), True, True, last_used=9.0)
    # an unrelated conversation, used longer ago: cutting it keeps nothing of it
    unrelated = SlotView(1, [1, 8, 8, 8, 8, 8], True, True, last_used=1.0)
    assert choose_slot([unrelated, own], prompt) == 0
    assert choose_slot([own, unrelated], prompt) == 0


def test_an_empty_slot_still_beats_cutting_a_resident_for_a_small_prefix():
    prompt = [1, 2, 3, 4]
    own = SlotView(0, prompt + list(range(10, 20)), True, True, last_used=9.0)
    empty = SlotView(1, [], True, True, last_used=1.0)
    assert choose_slot([own, empty], prompt) == 1
