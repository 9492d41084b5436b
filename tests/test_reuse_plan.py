"""Unit tests of the pure reuse planner (issue: conversation state reuse; restore action of the
hybrid-model issue)."""

import random

import pytest

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.reuse import Action, MissReason, common_prefix_length, plan_reuse

tok = ByteTokenizer()


def chat(*turns):
    roles = ["system", "user", "assistant"]
    messages = [{"role": roles[0], "content": turns[0]}]
    for i, content in enumerate(turns[1:]):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return tok.render_chat(messages).token_ids


def held_after(prompt, answer):
    """The held ids after a generation: the prompt plus the answer's tokens except the last one
    (the end-of-turn token is sampled but never fed back)."""
    return prompt + list(answer.encode())


def test_extension_reusing_46_of_69():
    held = list(range(46))
    new = list(range(69))
    plan = plan_reuse(held, new, can_rewind=True)
    assert (plan.action, plan.keep, plan.prefill, plan.reason) == (Action.EXTEND, 46, 23, None)
    assert plan.miss_line() is None
    assert plan_reuse(held, new, can_rewind=False).action is Action.EXTEND


def test_fork_in_a_huge_history():
    rng = random.Random(0)
    held = [rng.randrange(50_000) for _ in range(165_755)]
    new = held[:4_973] + [50_001, 50_002, 50_003, 50_004]
    assert len(new) == 4_977
    plan = plan_reuse(held, new, can_rewind=True)
    assert (plan.action, plan.keep, plan.prefill, plan.common) == (Action.REWIND, 4_973, 4, 4_973)
    assert plan.miss_line() == ("cache miss held=165755 prompt=4977 common=4973 action=rewind "
                                "reason=token-mismatch")
    no_rewind = plan_reuse(held, new, can_rewind=False)
    assert (no_rewind.action, no_rewind.keep, no_rewind.reason) == (Action.RESET, 0, MissReason.NO_REWIND)


def test_fully_cached_prompt_keeps_all_but_one():
    held = list(range(100))
    plan = plan_reuse(held, held[:60], can_rewind=True)
    assert (plan.action, plan.keep, plan.prefill) == (Action.REWIND, 59, 1)
    assert plan.miss_line().endswith("action=rewind reason=prompt-is-prefix")
    same = plan_reuse(held, held, can_rewind=True)
    assert (same.action, same.keep, same.prefill) == (Action.REWIND, 99, 1)
    assert plan_reuse(held, held, can_rewind=False).action is Action.RESET


SYSTEM = "You are a careful assistant."
PROMPT1 = chat(SYSTEM, "What is a lighthouse?")
ANSWER1 = "A tower with a light."
HELD = held_after(PROMPT1, ANSWER1)


def scenarios():
    yield "next turn", chat(SYSTEM, "What is a lighthouse?", ANSWER1, "And a buoy?"), Action.EXTEND
    yield "edited earlier message", chat(SYSTEM, "What is a lightship?", ANSWER1, "And a buoy?"), "fork"
    yield "different system prompt", chat("Be terse.", "What is a lighthouse?"), "fork"
    yield "regenerated answer", PROMPT1, "fork"
    yield "answer cut by a stop sequence", chat(SYSTEM, "What is a lighthouse?", "A tower", "More?"), "fork"
    yield "answer modified by the client", chat(SYSTEM, "What is a lighthouse?", "A TOWER with a light.", "More?"), "fork"


@pytest.mark.parametrize("can_rewind", [True, False])
@pytest.mark.parametrize("name,new,expected", list(scenarios()), ids=[s[0] for s in scenarios()])
def test_conversation_scenarios(name, new, expected, can_rewind):
    plan = plan_reuse(HELD, new, can_rewind=can_rewind)
    common = common_prefix_length(HELD, new)
    assert plan.common == common
    if expected is Action.EXTEND:
        assert (plan.action, plan.keep) == (Action.EXTEND, len(HELD))
        return
    assert common < len(HELD)
    if can_rewind:
        assert plan.action is Action.REWIND
        assert plan.keep == min(common, len(new) - 1)
        assert plan.keep > 0
    else:
        assert (plan.action, plan.keep, plan.reason) == (Action.RESET, 0, MissReason.NO_REWIND)


def test_answer_cut_by_stop_is_not_reused_beyond_the_cut():
    # The held state ends before the token that completed the stop sequence; the client sends
    # back only the text before the stop string, so the common prefix ends inside the answer.
    answer_prefix = "A tower"
    held = held_after(PROMPT1, "A tower with")  # generated up to and including the stop " with"
    new = chat(SYSTEM, "What is a lighthouse?", answer_prefix, "More?")
    plan = plan_reuse(held, new, can_rewind=True)
    assert plan.keep == len(PROMPT1) + len(answer_prefix)
    assert plan.action is Action.REWIND


@pytest.mark.parametrize("can_rewind", [True, False])
def test_empty_history_disabled_and_after_failure(can_rewind):
    new = chat(SYSTEM, "hi")
    assert plan_reuse([], new, can_rewind).reason is MissReason.EMPTY
    disabled = plan_reuse(HELD, HELD + [1, 2], can_rewind, enabled=False)
    assert (disabled.action, disabled.reason) == (Action.RESET, MissReason.DISABLED)
    failed = plan_reuse(HELD, HELD + [1, 2], can_rewind, after_failure=True)
    assert (failed.action, failed.reason) == (Action.RESET, MissReason.AFTER_FAILURE)
    assert "reason=after-failure" in failed.miss_line()


def test_no_common_prefix_resets():
    plan = plan_reuse([1, 2, 3], [4, 5], can_rewind=True)
    assert (plan.action, plan.reason, plan.keep) == (Action.RESET, MissReason.TOKEN_MISMATCH, 0)


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError):
        plan_reuse([1], [], True)


# --- restore (engines that cannot rewind) -------------------------------------------------------

def test_restore_picks_newest_checkpoint_at_or_below_common():
    held = list(range(8000))
    new = held[:4973] + [9, 9, 9, 9]
    plan = plan_reuse(held, new, can_rewind=False, checkpoint_positions=[1024, 2048, 4096, 5000, 8000])
    assert (plan.action, plan.keep, plan.checkpoint_position, plan.prefill) == (Action.RESTORE, 4096, 4096, 881)
    assert plan.miss_line().endswith("restore from checkpoint at 4096 of common 4973")


def test_restore_none_fits():
    held = list(range(300))
    new = held[:100] + [7]
    plan = plan_reuse(held, new, can_rewind=False, checkpoint_positions=[200, 300])
    assert (plan.action, plan.reason) == (Action.RESET, MissReason.NO_REWIND)


def test_regenerate_from_checkpoint_needs_no_prefill():
    prompt = list(range(50))
    held = prompt + [100, 101, 102]  # an answer was generated after the prompt
    plan = plan_reuse(held, prompt, can_rewind=False, checkpoint_positions=[20, 50])
    assert (plan.action, plan.keep, plan.prefill) == (Action.RESTORE, 50, 0)


def test_common_prefix_length_blocks():
    a = list(range(5000))
    for cut in (0, 1, 1023, 1024, 1025, 4999):
        b = a[:cut] + [-1] + a[cut + 1:]
        assert common_prefix_length(a, b) == cut
    assert common_prefix_length(a, a[:3000]) == 3000
    for cut in (0, 5, 2000, 4990, 4999):  # from a known common point, the tail differing or not
        b = a[:cut] + [-1] + a[cut + 1:]
        for start in (0, cut // 2, cut):  # the caller knows they agree up to start
            assert common_prefix_length(a, b, start=start) == cut
            assert common_prefix_length(b + [7], a, start=start) == cut
    assert common_prefix_length(a, list(a), start=4000) == 5000
    assert common_prefix_length(a[:10], a[:4], start=2) == 4


def test_generator_common_prefix_is_computed_once_per_plan_and_forgotten_on_execute(monkeypatch):
    from redlite.core import generation
    from redlite.core.byte_tokenizer import ByteTokenizer
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GenerationRequest
    from redlite.engine.echo import EchoEngine

    calls = []
    monkeypatch.setattr(generation, "common_prefix_length",
                        lambda a, b, start=0: calls.append(1) or common_prefix_length(a, b, start))
    gen = Generator(EchoEngine(), ByteTokenizer())
    gen.held_ids = [1, 2, 3, 4]
    prompt = [1, 2, 9, 9, 9]
    assert gen.common_with(prompt) == 2 and gen.common_with(prompt) == 2 and len(calls) == 1
    assert gen.common_with(list(prompt)) == 2 and len(calls) == 2  # another list: computed again
    gen.held_ids.append(5)
    assert gen.common_with(prompt) == 2 and len(calls) == 3  # resized: computed again
    gen.held_ids = [1, 2, 9, 4, 5]
    assert gen.common_with(prompt) == 3  # replaced
    gen._execute(gen.plan(prompt), GenerationRequest(prompt, 1))
    gen.held_ids[:] = [1, 2, 9, 9, 8]  # same list, same length, other ids: not taken from before
    assert gen.common_with(prompt) == 4


def test_the_same_prompt_list_again_is_known_held_without_comparing(monkeypatch):
    """A request's prompt list once brought into the state (a regenerate sends the render
    cache's same list) is known held up to what cuts left of it: its ids are not compared
    again; another list, a replaced state or a changed last id are compared from the start."""
    from redlite.core import generation
    from redlite.core.byte_tokenizer import ByteTokenizer
    from redlite.core.generation import Generator
    from redlite.core.generation_request import GenerationRequest
    from redlite.engine.echo import EchoEngine

    starts = []
    monkeypatch.setattr(generation, "common_prefix_length",
                        lambda a, b, start=0: starts.append(start) or common_prefix_length(a, b, start))
    gen = Generator(EchoEngine(), ByteTokenizer())
    prompt = [5, 6, 7, 8, 9, 10]
    *_, first = gen.run(GenerationRequest(prompt, 3))
    assert len(gen.held_ids) > len(prompt)  # the answer is held after it
    gen._common = None
    assert gen.common_with(prompt) == 6 and starts[-1] == 6  # nothing compared
    assert gen.common_with(list(prompt)) == 6 and starts[-1] == 0  # another list
    gen.sequence.cut(4)
    gen._common = None
    assert gen.common_with(prompt) == 4 and starts[-1] == 4  # what the cut left
    gen.held_ids[3] = 0  # against the contract: the last known id changed
    gen._common = None
    assert gen.common_with(prompt) == 3 and starts[-1] == 0
    gen.held_ids = list(prompt)  # replaced: nothing known
    gen._common = None
    assert gen.common_with(prompt) == 6 and starts[-1] == 0
