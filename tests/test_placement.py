"""Slot placement (redlite.core.placement): ties among slots that lose anyway, and the prefix
an empty slot copies from another idle slot."""

import pytest

from redlite.core.placement import SlotView, choose_slot, place

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


def test_a_small_shared_prefix_goes_to_an_empty_slot_that_copies_it():
    system = list(range(100, 130))
    resident = SlotView(0, system + list(range(1, 60)), True, True, last_used=9.0)
    empty = SlotView(1, [], True, True, last_used=1.0)
    prompt = system + [7, 7, 7]
    placed = place([resident, empty], prompt)
    assert (placed.slot, placed.source, placed.keep) == (1, 0, 30)
    assert "copies 30 tok of slot 0" in placed.reason


def test_an_engine_that_cannot_rewind_copies_up_to_a_checkpoint():
    system = list(range(100, 130))
    resident = SlotView(0, system + list(range(1, 60)), True, False, checkpoints=(20, 30, 50))
    empty = SlotView(1, [], True, False)
    placed = place([empty, resident], system[:25] + [7, 7])
    assert (placed.slot, placed.source, placed.keep) == (1, 0, 20)
    no_checkpoint = SlotView(0, resident.held_ids, True, False, checkpoints=(50,))
    assert place([empty, no_checkpoint], system + [7]).source is None


def test_no_copy_when_the_chosen_slot_keeps_as_much():
    prompt = [1, 2, 3, 4, 5, 6]
    fork = SlotView(0, [1, 2, 3, 4, 5, 9, 9], True, True)  # at least half kept: its own slot
    other = SlotView(1, [1, 2, 3, 8] + list(range(20, 40)), True, True)
    placed = place([other, fork], prompt)
    assert (placed.slot, placed.source) == (0, None)
    untrusted = SlotView(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], False, True)
    assert place([SlotView(3, [], True, True), untrusted], prompt).source is None


def test_another_conversation_with_a_long_shared_system_prompt_takes_the_empty_slot():
    """Where the resident's last answer starts is known: a prompt that shares more than half of
    the resident but cuts it before that answer is another conversation (or an edit), not a
    continuation: it copies the prefix into the empty slot rather than parking the resident."""
    system = list(range(100, 200))
    resident = SlotView(0, system + [1, 1, 1] + [5, 5, 5, 5], True, True, last_used=9.0, answer_start=103)
    empty = SlotView(1, [], True, True, last_used=1.0)
    placed = place([resident, empty], system + [2, 2, 2])
    assert (placed.slot, placed.source, placed.keep) == (1, 0, 100)
    # without the answer start the old share rule applies: at least half kept is a fork
    unknown = SlotView(0, resident.held_ids, True, True, last_used=9.0)
    assert place([unknown, empty], system + [2, 2, 2]).slot == 0


def test_a_cut_inside_the_last_answer_or_a_regenerate_keeps_its_own_slot():
    prompt = [1, 2, 3, 4]
    # the answer [10..19] spelled differently by the client: the cut falls inside it
    own = SlotView(0, prompt + list(range(10, 20)), True, True, last_used=9.0, answer_start=4)
    empty = SlotView(1, [], True, True, last_used=1.0)
    assert place([own, empty], prompt + [10, 11, 99, 5]).slot == 0
    assert place([own, empty], prompt).slot == 0  # a regenerate: the old answer is dropped
    edit = [1, 2, 3, 7]  # the last user message edited: cut before the answer
    assert place([own, empty], edit).slot == 1


def test_when_every_idle_slot_is_cut_the_least_recently_used_goes_not_the_one_sharing_most():
    """Two conversations with one system prompt, the other idle slot holding an older one: the
    newcomer cuts the older one and copies the system prompt, it does not park the conversation
    that was answered a moment ago (which would come back and park the newcomer in turn)."""
    system = list(range(100, 124))
    a = SlotView(0, system + [1] * 20 + [5] * 20, True, True, last_used=9.0, answer_start=44)
    old = SlotView(1, [100, 7, 7, 7], True, True, last_used=1.0, answer_start=2)
    placed = place([a, old], system + [2] * 20)
    assert (placed.slot, placed.source, placed.keep) == (1, 0, 24)


def test_placement_compares_each_slot_once_and_hands_the_chosen_slots_common_prefix_on(monkeypatch):
    from redlite.core import placement
    from redlite.core.reuse import common_prefix_length

    calls = []
    monkeypatch.setattr(placement, "common_prefix_length",
                        lambda a, b: calls.append(1) or common_prefix_length(a, b))
    prompt = [1, 2, 3, 4, 9]
    views = [SlotView(0, [1, 2, 3, 4, 5, 6], True, True, last_used=2.0),
             SlotView(1, [1, 2, 7], True, True, last_used=1.0),
             SlotView(2, [], True, True)]
    chosen = place(views, prompt)
    assert chosen.slot == 0 and chosen.common == 4 and len(calls) == 2  # the empty slot: none
    untrusted = place([SlotView(0, [1, 2, 3, 4, 5, 6], False, True)], prompt)
    assert untrusted.slot == 0 and untrusted.common is None
