"""The echo engine: model-free, deterministic, for testing the server core exactly.

Tokens are UTF-8 bytes (see :mod:`redlite.core.byte_tokenizer`). The engine "generates" by
echoing a chosen byte string: at the end of a prefill it takes as *source* the content of the
last user or tool message in the held sequence (the bytes between the last ``<|user|>`` or
``<|tool|>`` and the next ``<|end|>``), or the whole held byte sequence when there is no
``<|user|>`` token; it predicts the source byte that follows the longest end of its answer so
far that is a beginning of the source (so an unconstrained answer is the source, then
``<|end|>``), tracked as in Knuth-Morris-Pratt string matching. When a grammar mask or a logit
bias makes it write other bytes (forced markup, say), it picks the source up again where the
answer's end matches it. So the output is a function of the held token ids alone: a warm
(reused) and a cold state give the same answer, as with a model.

Its logits (:meth:`EchoLogits.scores`) give the predicted token 10, ``<|end|>`` 5, bytes of the
source not echoed yet ``2 - id/1000``, the JSON closers ``"`` ``}`` ``]`` 1.0/0.9/0.8 and every
other id ``-id/1000``; its sampler applies
logit bias, penalties and the grammar mask (:class:`~redlite.engine.logit_rules.NumpySampler`)
and takes the argmax whatever the temperature, so constrained output stays deterministic and
closes its JSON.

The held state is simulated as a list of token ids. ``can_rewind`` is configurable; without
rewind the engine offers checkpoints (a copy of its small "recurrent" state and the logits),
like a hybrid model. ``delay_ms`` slows each decoded token, ``prefill_delay_ms`` each
prefilled one (a slow prefill, to test interrupting it), ``snapshot_delay_ms`` each state
copy (slow parking and saving, to test signals then); a source containing the bytes
``FAIL!`` makes the first decode raise (to test failure handling). ``merged``: multi-byte
strings of ids 261, 262, ... (:class:`~redlite.core.byte_tokenizer.ByteTokenizer` with the same
``merged``); the engine then writes the longest merged string that the source continues with as
one token, where the tokenizer spells those bytes one by one (a re-tokenizing answer).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

from redlite.core.byte_tokenizer import END, TOOL, USER, VOCAB_SIZE
from redlite.core.kmp import prefix_function
from redlite.engine.base import Engine, EngineError, SamplingParams, StateSnapshot, TokenStream
from redlite.engine.echo_ranges import EchoRanges
from redlite.engine.echo_sampling import EchoLogits, EchoSampler, EchoStream
from redlite.engine.logit_rules import NumpySampler

__all__ = ["EchoEngine", "EchoLogits", "FAIL_MARKER"]

FAIL_MARKER = b"FAIL!"


class EchoEngine(EchoRanges, Engine):
    """See module docstring. max_context: tokens the simulated state can hold. pipelined:
    plain requests decode through a :class:`TokenStream` (one token ahead, undone at a stop)."""

    def __init__(self, can_rewind: bool = True, max_context: int = 1 << 20,
                 delay_ms: float = 0.0, model_id: str = "echo", prefill_delay_ms: float = 0.0,
                 snapshot_delay_ms: float = 0.0, device_resident: bool = False,
                 pipelined: bool = False, merged: tuple[bytes, ...] = ()) -> None:
        self._options = dict(can_rewind=can_rewind, max_context=max_context, delay_ms=delay_ms,
                             model_id=model_id, prefill_delay_ms=prefill_delay_ms,
                             snapshot_delay_ms=snapshot_delay_ms,
                             device_resident=device_resident, pipelined=pipelined, merged=merged)
        self.model_id = model_id
        self.pipelined = pipelined
        self.fed_ahead = 0  # tokens fed through a stream (tests)
        self.undone = 0     # stream feeds taken back
        self.device_resident = device_resident  # tests: on_device copies count as device memory
        self.can_rewind = can_rewind
        self.max_context = max_context
        self.merged = tuple(bytes(m) for m in merged)
        self.vocab_size = VOCAB_SIZE + len(self.merged)
        # merged strings longest first, with their ids
        self._merged_ids = sorted(((m, VOCAB_SIZE + k) for k, m in enumerate(self.merged)),
                                  key=lambda item: -len(item[0]))
        self.delay_ms = delay_ms
        self.prefill_delay_ms = prefill_delay_ms
        self.snapshot_delay_ms = snapshot_delay_ms
        self._held: list[int] = []
        self._source = b""
        self._generated = 0
        self._failure_of, self._failure = b"", []
        self.lock = threading.Lock()
        # Counters the tests read: how much work the engine really did.
        self.prefill_calls = 0
        self.prefilled_tokens = 0
        self.decoded_tokens = 0

    @property
    def n_past(self) -> int:
        return len(self._held)

    @property
    def held_ids(self) -> list[int]:
        """A copy of the simulated held sequence (for tests)."""
        return list(self._held)

    def reset(self) -> None:
        self._held.clear()
        self._source, self._generated = b"", 0

    def _logits(self) -> EchoLogits:
        at, source = self._generated, self._source
        if at < len(source):
            token = next((i for m, i in self._merged_ids if source.startswith(m, at)), source[at])
            return EchoLogits(token, source[at:], self.vocab_size)
        return EchoLogits(END, b"", self.vocab_size)

    def _bytes_of(self, token: int) -> bytes:
        """The bytes of a byte or merged id (b"" for a special token)."""
        if token < 256:
            return bytes([token])
        k = token - VOCAB_SIZE
        return self.merged[k] if 0 <= k < len(self.merged) else b""

    def prefill(self, token_ids: Sequence[int]) -> EchoLogits:
        if not token_ids:
            raise EngineError("prefill needs at least one token")
        if self.n_past + len(token_ids) > self.max_context:
            raise EngineError(f"context overflow: {self.n_past} + {len(token_ids)} > {self.max_context}")
        if self.prefill_delay_ms:
            time.sleep(self.prefill_delay_ms * len(token_ids) / 1000.0)
        self._held.extend(int(t) for t in token_ids)
        self.prefill_calls += 1
        self.prefilled_tokens += len(token_ids)
        self._source = self._compute_source(self._held)
        self._generated = 0
        return self._logits()

    def _compute_source(self, held: list[int]) -> bytes:
        start = next((i for i in range(len(held) - 1, -1, -1) if held[i] in (USER, TOOL)), None)
        if start is None:
            return b"".join(self._bytes_of(t) for t in held)
        content = []
        for token in held[start + 1:]:
            if token == END:
                break
            content.append(self._bytes_of(token))
        return b"".join(content)

    def decode(self, token_id: int) -> EchoLogits:
        if FAIL_MARKER in self._source:
            raise RuntimeError("echo engine: injected failure (source contains FAIL!)")
        if self.n_past + 1 > self.max_context:
            raise EngineError(f"context overflow: {self.n_past} + 1 > {self.max_context}")
        if self.delay_ms:
            time.sleep(self.delay_ms / 1000.0)
        token_id = int(token_id)
        merged = token_id - VOCAB_SIZE in range(len(self.merged))
        for byte in self._bytes_of(token_id) if merged else (token_id,):
            self._generated = self._match_step(self._generated, byte)
        self._held.append(int(token_id))
        self.decoded_tokens += 1
        return self._logits()

    def _match_step(self, matched: int, token: int) -> int:
        """Length of the longest end of (answer + ``token``) that begins the source, given
        ``matched`` for the answer (the Knuth-Morris-Pratt automaton over the source)."""
        source = self._source
        if self._failure_of != source:
            self._failure = prefix_function(source)
            self._failure_of = source
        if matched == len(source) and matched:
            matched = self._failure[matched - 1]
        while matched and source[matched] != token:
            matched = self._failure[matched - 1]
        return matched + 1 if matched < len(source) and source[matched] == token else matched

    def rewind(self, n_tokens: int) -> None:
        if not self.can_rewind:
            raise EngineError("echo engine configured without rewind")
        if not 0 <= n_tokens <= self.n_past:
            raise EngineError(f"cannot rewind to {n_tokens} of {self.n_past} tokens")
        del self._held[n_tokens:]
        # Like a KV cache: the state is the tokens; the next prefill recomputes the source.

    def new_slot(self) -> "EchoEngine":
        """A fresh echo engine with this one's options (no model to share; the default
        :meth:`decode_batch` loop serves the pool). Options changed after construction
        (``delay_ms``, say) are copied as they are now."""
        options = dict(self._options, delay_ms=self.delay_ms, prefill_delay_ms=self.prefill_delay_ms,
                       snapshot_delay_ms=self.snapshot_delay_ms, max_context=self.max_context)
        return EchoEngine(**options)

    def copy_prefix(self, source: Engine, n_tokens: int) -> None:
        """:meth:`Engine.copy_prefix` from another echo engine: its first ``n_tokens`` held ids
        (the "recurrent" part, its source, only with all of them: else it comes from a
        checkpoint or the next prefill)."""
        if source is self or not isinstance(source, EchoEngine) or source.model_id != self.model_id:
            raise EngineError("copy_prefix takes another echo slot of this model")
        if not 0 <= n_tokens <= min(source.n_past, self.max_context):
            raise EngineError(f"cannot copy {n_tokens} of {source.n_past} tokens")
        self._held = list(source._held[:n_tokens])
        whole = n_tokens == source.n_past
        self._source, self._generated = (source._source, source._generated) if whole else (b"", 0)

    def make_sampler(self, params: SamplingParams, prompt_ids: Sequence[int] = (),
                     constraint=None) -> NumpySampler:
        return EchoSampler(params, prompt_ids, constraint)

    def token_stream(self, params: SamplingParams, logits: EchoLogits) -> TokenStream | None:
        if not self.pipelined or params.needs_host:
            return None
        return EchoStream(self, logits)

    def snapshot(self) -> StateSnapshot:
        if self.snapshot_delay_ms:
            time.sleep(self.snapshot_delay_ms / 1000.0)
        return StateSnapshot(
            n_past=self.n_past,
            tensors={"held": np.asarray(self._held, dtype=np.int64)},
            meta={"source": self._source.hex(), "generated": self._generated},
            tensor_format="numpy",
        )

    def restore(self, snapshot: StateSnapshot) -> None:
        self._held = [int(t) for t in snapshot.tensors["held"]]
        self._source = bytes.fromhex(snapshot.meta.get("source", ""))
        self._generated = int(snapshot.meta.get("generated", 0))

    def state_nbytes(self) -> int:
        return 8 * self.n_past

    def fingerprint(self) -> str:
        return f"echo-v1-rewind{int(self.can_rewind)}"
