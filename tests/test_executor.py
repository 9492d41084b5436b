"""The engine executor (core/executor.py): decodes of several slots posted from their threads
run as one decode_batch; a batch refused for a full context runs slot by slot; after close,
calls run on the caller's thread."""

import threading

import pytest

from redlite.core.executor import EngineExecutor, SlotProxy
from redlite.engine.base import EngineError
from redlite.engine.echo import EchoEngine


class CountingEcho(EchoEngine):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.batch_sizes = []

    def decode_batch(self, slots, token_ids):
        self.batch_sizes.append(len(slots))
        return super().decode_batch(slots, token_ids)


def decode_together(proxies, tokens):
    """Each proxy decodes its token from its own thread, all at once; results or errors."""
    out = [None] * len(proxies)

    def run(i):
        try:
            out[i] = proxies[i].decode(tokens[i])
        except EngineError as error:
            out[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(proxies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_decodes_of_the_decoding_slots_run_as_one_batch():
    pool = CountingEcho(max_context=64)
    slots = [pool, pool.new_slot(), pool.new_slot()]
    executor = EngineExecutor(pool, batch_wait_s=5.0)
    try:
        proxies = [SlotProxy(s, executor) for s in slots]
        for proxy in proxies:
            proxy.prefill([1, 2])
        decode_together(proxies, [3, 4, 5])  # the first round: each slot joins as it posts
        pool.batch_sizes.clear()
        out = decode_together(proxies, [6, 7, 8])  # all three are decoding: one batch
        assert pool.batch_sizes == [3]
        assert [s.held_ids[-1] for s in slots] == [6, 7, 8] and all(o is not None for o in out)
    finally:
        executor.close()


def test_a_full_context_fails_only_its_own_slot():
    pool = EchoEngine(max_context=4)
    full, other = pool, pool.new_slot()
    executor = EngineExecutor(pool, batch_wait_s=0.05)
    try:
        a, b = SlotProxy(full, executor), SlotProxy(other, executor)
        a.prefill([1, 2, 3, 4])
        b.prefill([1, 2])
        out = decode_together([a, b], [5, 6])
        assert isinstance(out[0], EngineError) and not isinstance(out[1], EngineError)
        assert full.n_past == 4 and other.held_ids == [1, 2, 6]
    finally:
        executor.close()


def test_after_close_calls_run_on_the_callers_thread():
    pool = EchoEngine()
    executor = EngineExecutor(pool)
    assert executor.close()
    proxy = SlotProxy(pool, executor)
    proxy.prefill([1, 2])
    proxy.decode(3)
    assert pool.held_ids == [1, 2, 3]
    with pytest.raises(EngineError):
        proxy.rewind(9)


def test_a_batch_lists_its_slots_in_the_order_they_were_made():
    pool = CountingEcho()
    slots = [pool, pool.new_slot(), pool.new_slot()]
    seen = []
    original = pool.decode_batch
    pool.decode_batch = lambda batch, tokens: (seen.append([slots.index(s) for s in batch]),
                                               original(batch, tokens))[1]
    executor = EngineExecutor(pool, batch_wait_s=5.0)
    try:
        proxies = [SlotProxy(s, executor) for s in slots]
        for proxy in proxies:
            proxy.prefill([1])
        decode_together(proxies, [2, 3, 4])
        seen.clear()
        for _ in range(3):
            decode_together(proxies[::-1], [5, 6, 7])  # posted in another order each time
        assert seen == [[0, 1, 2]] * 3
    finally:
        executor.close()


def test_token_stream_feeds_ahead_and_undo_leaves_the_slot_as_before():
    """A slot's executor token stream: each feed's decode runs in a batch without the lane
    waiting for it; :meth:`undo` withdraws a feed that has not run (nothing changed) and
    rewinds one that has; ``n_past`` as the generator sees it counts the posted feeds."""
    from redlite.engine.base import SamplingParams

    pool = EchoEngine(max_context=64)
    executor = EngineExecutor(pool, batch_wait_s=5.0, decode_ahead=True)
    try:
        proxy = SlotProxy(pool, executor)
        logits = proxy.prefill([1, 2, 3])
        stream = proxy.token_stream(SamplingParams(temperature=0.0), logits)
        first = stream.read()  # sampled from the prefill's logits, not fed
        assert proxy.n_past == 3
        tokens = [first]
        for _ in range(3):  # the token loop: feed the token about to be read, then read it
            stream.feed()
            tokens.append(stream.read())
        assert proxy.n_past == 6
        stream.undo()  # the last fed token ends the answer: take it back
        assert proxy.n_past == 5 and pool.n_past == 5
        assert pool.held_ids == [1, 2, 3] + tokens[:2]
        proxy.rest()
        assert proxy.n_past == pool.n_past == 5
    finally:
        executor.close()


def test_token_stream_undo_of_a_feed_not_run_yet_withdraws_it():
    from redlite.engine.base import SamplingParams

    pool = EchoEngine(max_context=64)
    other = pool.new_slot()
    executor = EngineExecutor(pool, batch_wait_s=30.0, decode_ahead=True)
    try:
        a, b = SlotProxy(pool, executor), SlotProxy(other, executor)
        b.prefill([9])
        threading.Thread(target=b.decode, args=(8,), daemon=True).start()  # b joins the batches
        logits = a.prefill([1, 2])
        while b not in executor._decoding:
            threading.Event().wait(0.01)
        executor._decodes.pop(b, None)  # b stops posting: a's next feed waits in the queue
        stream = a.token_stream(SamplingParams(temperature=0.0), logits)
        stream.read()
        stream.feed()  # posted, but the batch waits for b
        stream.undo()
        assert a.n_past == pool.n_past == 2 and pool.held_ids == [1, 2]
    finally:
        executor.close(wait_s=1.0)
