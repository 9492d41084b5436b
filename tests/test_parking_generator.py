"""Parking through the Generator in-process with the echo engine (no server, no HTTP)."""

import errno
import logging
import random

import pytest

from redlite.core.byte_tokenizer import ByteTokenizer
from redlite.core.conversations import Conversations
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult, GeneratorSettings
from redlite.core.parking import ParkingPool
from redlite.core.prefix_index import block_hashes
from redlite.core.sessions import SessionStore, expected_for
from redlite.engine.echo import EchoEngine

tok = ByteTokenizer()
SYSTEM = {"role": "system", "content": "You are terse."}


def make(can_rewind=True, park_bytes=1 << 20, slots=8, session_dir=None, opener=open, parking=True,
         interval=16, block=128):
    engine = EchoEngine(can_rewind=can_rewind)
    gen = Generator(engine, tok, GeneratorSettings(checkpoint_interval=interval))
    if parking:
        sessions = None
        if session_dir is not None:
            sessions = SessionStore(session_dir, expected_for(engine), min_tokens=1, opener=opener,
                                    block=block)
            sessions.scan()
        gen.parking = Conversations(ParkingPool(park_bytes, slots, block=block), sessions)
    return gen


def chat(gen, messages):
    rendered = tok.render_chat(messages)
    request = GenerationRequest(rendered.token_ids, message_ends=rendered.message_ends)
    out = list(gen.run(request))
    result = out[-1]
    assert isinstance(result, GenerationResult)
    assert gen.engine.held_ids == gen.held_ids  # held ids and engine agree after every request
    for size, chain in gen.sequence._chains.items():  # the kept hashes (cut, seeded) are exact
        assert chain == list(block_hashes(gen.held_ids, size))[:len(chain)]
    return "".join(event.value for event in out[:-1]), result


def held_len(messages, answer):
    return len(tok.render_chat(messages).token_ids) + len(answer.encode())


A = [SYSTEM, {"role": "user", "content": "Conversation A is about lighthouses and fog."}]
B = [SYSTEM, {"role": "user", "content": "Sub-agent B greps the repository for to-do."}]


def follow(messages, answer, user):
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]


@pytest.mark.parametrize("can_rewind", [True, False])
def test_a_b_a_restores_a_from_ram(can_rewind, caplog):
    caplog.set_level(logging.INFO)
    gen, cold = make(can_rewind), make(can_rewind, parking=False)
    answer_a, _ = chat(gen, A)
    chat(gen, B)
    a_held = held_len(A, answer_a)
    third = follow(A, answer_a, "And the fog horn?")
    prefilled = gen.engine.prefilled_tokens
    answer, result = chat(gen, third)
    assert result.cached_tokens == a_held
    assert gen.engine.prefilled_tokens - prefilled == len(tok.render_chat(third).token_ids) - a_held
    assert f"restored from ram {a_held} tok" in caplog.text
    assert "parked" in caplog.text
    # the same answers as a server that never parks
    chat(cold, A), chat(cold, B)
    assert chat(cold, third)[0] == answer


def test_no_rewind_fork_restores_a_parked_checkpoint(caplog):
    caplog.set_level(logging.INFO)
    gen = make(can_rewind=False, interval=0)  # checkpoints at message boundaries only
    answer1, _ = chat(gen, A)
    second = follow(A, answer1, "Tell me more about the keepers.")
    chat(gen, second)
    chat(gen, B)  # A (with its checkpoints) is parked
    edited = follow(A, answer1, "Tell me about the lenses instead.")
    _, result = chat(gen, edited)
    # the newest checkpoint of A at or below the common prefix: the end of A's first answer
    # message (a message boundary of the second prompt)
    boundary = len(tok.render_chat(follow(A, answer1, "x")[:3]).token_ids) - 1
    assert result.cached_tokens == boundary
    assert "restored from ram" in caplog.text
    assert "action=restore" in caplog.text


def test_ram_pool_never_exceeds_its_bounds():
    rng = random.Random(5)
    budget, slots = 900, 3
    gen = make(park_bytes=budget, slots=slots)
    pool = gen.parking.pool
    conversations = {}
    for step in range(60):
        name = rng.randrange(6)
        messages = conversations.get(name) or [SYSTEM, {"role": "user", "content": f"topic {name} " * rng.randint(1, 6)}]
        answer, _ = chat(gen, messages)
        conversations[name] = follow(messages, answer, f"step {step}")[-6:]
        assert pool.nbytes <= budget and len(pool) <= slots


def test_the_entry_prefixing_the_prompt_is_not_evicted(caplog):
    caplog.set_level(logging.INFO)
    gen = make(slots=1)
    answer_a, _ = chat(gen, A)
    chat(gen, B)  # A parked in the only slot
    _, result = chat(gen, follow(A, answer_a, "again"))  # B must not push A out first
    assert result.cached_tokens == held_len(A, answer_a)
    assert "restored from ram" in caplog.text


def test_live_state_extended_by_the_prompt_is_not_parked(caplog):
    caplog.set_level(logging.INFO)
    gen = make()
    answer, _ = chat(gen, A)
    chat(gen, follow(A, answer, "next"))
    assert "parked" not in caplog.text and len(gen.parking.pool) == 0


def test_failed_restore_runs_cold(caplog):
    caplog.set_level(logging.INFO)
    gen, cold = make(), make(parking=False)
    answer_a, _ = chat(gen, A)
    chat(gen, B)

    def broken(snapshot):
        raise RuntimeError("device lost")
    gen.engine.restore = gen.engine.restore_range = broken  # whole or tail entries
    third = follow(A, answer_a, "And the fog horn?")
    answer, result = chat(gen, third)
    assert "restore failed" in caplog.text
    assert result.cached_tokens == 0
    chat(cold, A), chat(cold, B)
    assert chat(cold, third)[0] == answer


def test_full_disk_is_logged_and_the_request_served(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    def full_disk(path, mode):
        raise OSError(errno.ENOSPC, "No space left on device")
    gen = make(park_bytes=0, session_dir=tmp_path, opener=full_disk)
    answer_a, _ = chat(gen, A)
    chat(gen, B)  # A cannot be parked in RAM (0 bytes) and its save fails
    answer, result = chat(gen, follow(A, answer_a, "more"))
    assert "save failed" in caplog.text and "No space left" in caplog.text
    assert result.cached_tokens < held_len(A, answer_a) and answer == "more"  # not restored
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".rl-owner-")] == []


def test_a_b_a_through_disk_in_process(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    gen = make(park_bytes=0, session_dir=tmp_path)
    answer_a, _ = chat(gen, A)
    chat(gen, B)
    _, result = chat(gen, follow(A, answer_a, "more"))
    a_held = held_len(A, answer_a)
    assert result.cached_tokens == a_held
    assert f"restored from disk {a_held} tok" in caplog.text



@pytest.mark.parametrize("through_disk", [False, True])
def test_held_hashes_stay_exact_through_forks_restores_and_regenerates(tmp_path, through_disk, caplog):
    """The slot's kept hashes of its held ids (seeded from a restored entry's index, cut with
    a rewind) are those of its ids after every request (checked in ``chat``), and a restore
    from the RAM pool or from disk seeds them."""
    caplog.set_level(logging.INFO)
    gen = make(park_bytes=0 if through_disk else 1 << 20, session_dir=tmp_path if through_disk else None,
               block=4)
    answer_a, _ = chat(gen, A)
    chat(gen, A)  # a regenerate: the answer's tail parked, the live state rewound
    chat(gen, B)
    seeded = []
    real = gen.sequence.know_hashes
    gen.sequence.know_hashes = lambda block, hashes: seeded.append(len(hashes)) or real(block, hashes)
    chat(gen, follow(A, answer_a, "and then?"))
    assert f"restored from {'disk' if through_disk else 'ram'}" in caplog.text
    assert seeded and seeded[0] > 8
    chat(gen, follow(A, answer_a, "and then?"))


def test_prompt_blocks_are_hashed_with_the_prefill_not_by_the_next_selection(monkeypatch):
    """A new conversation's prompt blocks are hashed once its prefill is queued (on a GPU the
    host does it while the device computes), so the regenerate's candidate step hashes at
    most the blocks the answer added."""
    import redlite.core.sequence as sequence_module

    gen = make(block=4)
    messages = [SYSTEM, {"role": "user", "content": "Lighthouses and fog, at length. " * 20}]
    prompt_len = len(tok.render_chat(messages).token_ids)
    hashed: list[tuple[int, int]] = []  # (first block, end block) per call, during selections
    real_hashes = sequence_module.block_hashes

    def counting(ids, block, limit=None, start=0, previous=b""):
        out = list(real_hashes(ids, block, limit=limit, start=start, previous=previous))
        hashed.append((start, start + len(out)))
        return out
    real_select = gen.parking.select
    selecting = []

    def select(*args, **kwargs):
        selecting.append(True)
        try:
            return real_select(*args, **kwargs)
        finally:
            selecting.pop()
    monkeypatch.setattr(gen.parking, "select", select)
    monkeypatch.setattr(sequence_module, "block_hashes",
                        lambda *a, **k: counting(*a, **k) if selecting else real_hashes(*a, **k))
    chat(gen, messages)
    hashed.clear()
    _, result = chat(gen, messages)  # regenerate: the old answer's tail is parked
    assert result.cached_tokens == prompt_len - 1
    assert hashed and all(first >= (prompt_len - 1) // 4 for first, _ in hashed), hashed


def test_a_forks_parked_tail_enters_the_pool_once_the_second_token_is_read(monkeypatch):
    """A regenerate copies the old answer's tail before the cut, but the pool's bookkeeping
    (admission, index, log) waits until the second token is read (not in the TTFT, nor
    holding the GIL while the first token's chunk is written);
    the entry is then parked as before, also when the client leaves at the first token, and
    a failing prefill does not lose it."""
    gen = make(block=4)
    messages = [SYSTEM, {"role": "user", "content": "Lighthouses and fog."}]
    answer, _ = chat(gen, messages)
    order = []
    real_add, real_prefill, real_decode = gen.parking.pool.add, gen.engine.prefill, gen.engine.decode
    monkeypatch.setattr(gen.parking.pool, "add", lambda *a, **k: order.append("pool") or real_add(*a, **k))
    monkeypatch.setattr(gen.engine, "prefill", lambda ids: order.append("prefill") or real_prefill(ids))
    monkeypatch.setattr(gen.engine, "decode", lambda t: order.append("decode") or real_decode(t))
    chat(gen, messages)  # regenerate: the answer's tail is parked
    # the first token fed back (its chunk is out), the second read and fed back, then the pool
    assert order[:4] == ["prefill", "decode", "decode", "pool"] and order.count("pool") == 1
    assert len(gen.parking.pool) == 1
    rendered = tok.render_chat(messages)
    events = gen.run(GenerationRequest(rendered.token_ids, message_ends=rendered.message_ends))
    keys = [e.key for e in gen.parking.pool.entries()]
    next(events)  # the first token's event: its tail not yet in the pool
    assert [e.key for e in gen.parking.pool.entries()] == keys
    next(events)  # the second one's: not yet either (it is settled once that token is held)
    assert [e.key for e in gen.parking.pool.entries()] == keys
    events.close()  # the client leaves: the tail is parked all the same (superseding the same one)
    assert [e.key for e in gen.parking.pool.entries()] not in ([], keys)
    _, restored = chat(gen, follow(messages, answer, "and then?"))  # the parked answer is used
    assert restored.cached_tokens >= len(tok.render_chat(messages).token_ids) + len(answer.encode()) - 8

    def failing(ids):
        raise RuntimeError("device lost")
    monkeypatch.setattr(gen.engine, "prefill", failing)
    held = list(gen.held_ids)
    with pytest.raises(RuntimeError):
        chat(gen, messages)  # a fork again: its tail is copied, then the prefill fails
    assert any(entry.held_ids == held for entry in gen.parking.pool.entries())


def test_entries_longer_than_the_context_are_not_candidates(caplog):
    caplog.set_level(logging.INFO)
    gen = make()
    answer_a, _ = chat(gen, A)
    chat(gen, B)
    fork = [SYSTEM, {"role": "user", "content": A[1]["content"][:-5] + "rain."}]
    fork_len = len(tok.render_chat(fork).token_ids)
    assert fork_len < held_len(A, answer_a)
    gen.engine.max_context = fork_len + 1  # as if restarted with a smaller --ctx-size
    _, result = chat(gen, fork)
    assert "restored from" not in caplog.text
    assert result.cached_tokens == len(tok.render_chat([SYSTEM]).token_ids)  # common with B: system + <|user|>


def test_a_forked_parked_entry_stays_parked_and_protected(caplog):
    caplog.set_level(logging.INFO)
    gen = make(slots=1)
    answer_a, _ = chat(gen, A)
    chat(gen, B)  # A parked in the only slot
    fork = [SYSTEM, {"role": "user", "content": A[1]["content"][:-5] + "rain."}]
    _, result = chat(gen, fork)  # restored from A, cut back: A stays parked; B cannot push it out
    assert result.cached_tokens == len(tok.render_chat(fork).token_ids) - len("rain.") - 2
    assert "restored from ram" in caplog.text
    assert [len(e.held_ids) for e in gen.parking.pool.entries()] == [held_len(A, answer_a)]
    _, result = chat(gen, follow(A, answer_a, "back to A"))
    assert result.cached_tokens == held_len(A, answer_a)


def test_no_rewind_checkpoints_travel_through_disk(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    gen, cold = make(can_rewind=False, park_bytes=0, session_dir=tmp_path, interval=0), \
        make(can_rewind=False, parking=False, interval=0)
    answer1, _ = chat(gen, A)
    second = follow(A, answer1, "Tell me more about the keepers.")
    chat(gen, second)
    chat(gen, B)  # A goes to disk with its checkpoints (engine tensors + metadata)
    edited = follow(A, answer1, "Tell me about the lenses instead.")
    answer, result = chat(gen, edited)
    assert result.cached_tokens == len(tok.render_chat(follow(A, answer1, "x")[:3]).token_ids) - 1
    assert "restored from disk" in caplog.text and "action=restore" in caplog.text
    for messages in (A, second, B):
        chat(cold, messages)
    assert chat(cold, edited)[0] == answer


def test_the_restore_line_is_written_after_the_first_token_not_before_it(caplog):
    """Logging is host time: a restored conversation's line waits for the request's first token
    (and comes before its cache-miss and prefill lines)."""
    caplog.set_level(logging.INFO)
    gen = make()
    answer_a, _ = chat(gen, A)
    chat(gen, B)
    rendered = tok.render_chat(follow(A, answer_a, "And the fog horn?"))
    request = GenerationRequest(rendered.token_ids, message_ends=rendered.message_ends, request_id="req-3")
    events = gen.run(request)
    first = next(events)
    assert not isinstance(first, GenerationResult) and "restored from" not in caplog.text
    rest = list(events)
    assert isinstance(rest[-1], GenerationResult)
    lines = [r.getMessage() for r in caplog.records]
    restored = next(i for i, line in enumerate(lines) if line.startswith("req-3 restored from ram"))
    prefill = next(i for i, line in enumerate(lines) if line.startswith("req-3 prefill"))
    assert restored < prefill and request.notes == []
