"""The pipelined token loop (decode one token ahead of the host, undone at a stop) and the
device sampler, on the CPU: the echo engine's stream, a tiny llama and a tiny Qwen3.5 hybrid
through the graph decoder's static path run eagerly. The pipelined answers, held ids and
engine states must equal the host-sampled ones."""

from __future__ import annotations

import pytest
import torch

from redlite.core.byte_tokenizer import VOCAB_SIZE, ByteTokenizer
from redlite.core.chat import OutputEvent
from redlite.core.generation import Generator
from redlite.core.generation_request import GenerationRequest, GenerationResult, GeneratorSettings
from redlite.engine.base import SamplingParams
from redlite.engine.device_sampling import GREEDY, SAMPLE, DeviceSampling, mode_of, sample_into
from redlite.engine.echo import EchoEngine
from redlite.engine.torch_engine import TorchEngine
from redlite.models.llama import LlamaModel

tok = ByteTokenizer()


def run(gen: Generator, prompt: list[int], **fields) -> tuple[str, GenerationResult]:
    items = list(gen.run(GenerationRequest(prompt, **fields)))
    text = "".join(i.value for i in items if isinstance(i, OutputEvent))
    return text, items[-1]


def chat(text: str) -> list[int]:
    return tok.render_chat([{"role": "user", "content": text}]).token_ids


# --- the generator's loop on the echo engine --------------------------------------------------

CASES = [
    dict(),                                         # end of turn: the fed END is undone
    dict(stop=["lo w"]),                            # a stop sequence: undone
    dict(max_tokens=4),                             # max_tokens: the last token is not fed
    dict(n=2, sampling=SamplingParams(seed=3)),     # choices one after another
]


@pytest.mark.parametrize("fields", CASES)
@pytest.mark.parametrize("rewind", [True, False])
def test_echo_pipelined_equals_host_loop(fields, rewind):
    outs = {}
    for pipelined in (False, True):
        engine = EchoEngine(can_rewind=rewind, pipelined=pipelined)
        gen = Generator(engine, tok)
        first = run(gen, chat("hello world"), **fields)
        second = run(gen, chat("hello world") + [ord("x")] + chat("again"), **fields)
        assert engine.n_past == len(gen.held_ids) and engine.held_ids == gen.held_ids
        assert not gen.failed
        outs[pipelined] = (first[0], first[1].finish_reason, second[0], second[1].finish_reason,
                           list(gen.held_ids), first[1].answer_ids)
        if pipelined:
            assert engine.fed_ahead > 0
            assert engine.undone == (0 if "max_tokens" in fields else 2 * fields.get("n", 1))
    assert outs[True] == outs[False]


def test_echo_context_full_is_not_fed_ahead():
    prompt = chat("hello world")
    engine = EchoEngine(max_context=len(prompt) + 3, pipelined=True)
    gen = Generator(engine, tok)
    text, result = run(gen, prompt)
    assert (text, result.finish_reason) == ("hell", "length")
    assert engine.n_past == len(gen.held_ids) == len(prompt) + 3 and engine.undone == 0


def test_echo_cancel_mid_answer_undoes_the_fed_token():
    engine = EchoEngine(pipelined=True)
    gen = Generator(engine, tok)
    request = GenerationRequest(chat("hello world"))
    seen = []
    for item in gen.run(request):
        if isinstance(item, OutputEvent):
            seen.append(item.value)
            if len(seen) == 3:
                request.cancelled.set()
    assert item.finish_reason == "cancelled" and "".join(seen) == "hel"
    assert engine.n_past == len(gen.held_ids) and engine.undone == 1 and not gen.failed


def test_echo_failure_mid_stream_marks_history_failed():
    engine = EchoEngine(pipelined=True)
    gen = Generator(engine, tok)
    with pytest.raises(RuntimeError):
        run(gen, chat("FAIL!"))
    assert gen.failed
    text, result = run(gen, chat("fine"))  # the next request resets and serves
    assert text == "fine" and result.plan.reason.value == "after-failure"


def test_host_path_for_logit_rules_and_logprobs():
    engine = EchoEngine(pipelined=True)
    gen = Generator(engine, tok)
    run(gen, chat("abc"), sampling=SamplingParams(logprobs=1))
    run(gen, chat("abc"), sampling=SamplingParams(logit_bias=((ord("b"), -100.0),)))
    assert engine.fed_ahead == 0
    assert mode_of(SamplingParams(temperature=0)) == GREEDY and mode_of(SamplingParams()) == SAMPLE
    assert mode_of(SamplingParams(presence_penalty=1.0)) is None


# --- a tiny llama: the graph decoder's static step, eagerly on the CPU -------------------------

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE,
             max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)


def tiny_llama(seed=0) -> LlamaModel:
    model = LlamaModel(LLAMA)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


class _Tok(ByteTokenizer):
    """Byte tokenizer with another end-of-turn id (random weights rarely pick END)."""

    def __init__(self, eos: int):
        super().__init__()
        self.eos_token_ids = frozenset({eos})


def _state_logits(engine, held: list[int], extra: list[int]) -> torch.Tensor:
    """Logits after ``extra`` on the engine's held state (must hold ``held``)."""
    assert engine.n_past == len(held)
    return engine.prefill(extra)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(seed=5, top_k=20, top_p=0.9)])
def test_tiny_llama_pipelined_equals_host_and_state_consistent(params):
    model = tiny_llama()
    prompt = chat("hi there")
    static = TorchEngine(model, ctx_size=256, cuda_graphs=True)    # stream (eager static step)
    eager = TorchEngine(model, ctx_size=256, cuda_graphs=False)    # host sampling
    probe = Generator(static, tok)
    answer = run(probe, prompt, max_tokens=12, sampling=params)[1].answer_ids
    eos = answer[6]  # end the turn at its first occurrence: the fed token must be undone
    cut = answer.index(eos)
    static.reset()
    gen = Generator(static, _Tok(eos))
    text, result = run(gen, prompt, max_tokens=40, sampling=params)
    assert result.finish_reason == "stop" and result.answer_ids == answer[:cut]
    assert gen.held_ids == prompt + answer[:cut]
    # the state holds exactly the held ids: equal logits to a cold prefill of them
    warm = _state_logits(static, gen.held_ids, [1, 2])
    cold = eager.prefill(gen.held_ids + [1, 2])
    torch.testing.assert_close(warm, cold, rtol=1e-4, atol=1e-4)
    if params.greedy:  # the host sampler gives the same greedy answer
        eager.reset()
        host = Generator(eager, _Tok(eos))
        assert run(host, prompt, max_tokens=40, sampling=params)[1].answer_ids == answer[:cut]


def test_tiny_llama_same_seed_same_output():
    model = tiny_llama(seed=1)
    engine = TorchEngine(model, ctx_size=256, cuda_graphs=True)
    outs = []
    for seed in (7, 7, 8):
        engine.reset()
        gen = Generator(engine, tok)
        outs.append(run(gen, chat("x"), max_tokens=16, sampling=SamplingParams(seed=seed))[1].answer_ids)
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_sampling_mode_that_cannot_be_captured_falls_back_to_eager_sampling(monkeypatch):
    from redlite.engine import cuda_graphs

    class FakeGraph:  # "replays" the logits step eagerly into its output buffer
        def __init__(self, decoder, span, out):
            self.decoder, self.span, self.out = decoder, span, out

        def replay(self):
            self.out.copy_(self.decoder._body(self.span, cuda_graphs.LOGITS))

    def capture(self, span, mode):
        if mode != cuda_graphs.LOGITS:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = FakeGraph(self, span, torch.zeros(1, self.model.vocab_size))
        self._graphs[(span, mode)] = (graph, graph.out)
        return graph, graph.out

    model = tiny_llama(seed=3)
    params = SamplingParams(seed=11, top_p=0.8)
    plain = TorchEngine(model, ctx_size=256, cuda_graphs=True)  # the eager static step
    want = run(Generator(plain, tok), chat("x"), max_tokens=12, sampling=params)[1].answer_ids
    engine = TorchEngine(model, ctx_size=256, cuda_graphs=True)
    decoder = engine.graph_decoder()
    decoder.use_graphs = True
    monkeypatch.setattr(cuda_graphs.GraphDecoder, "_capture", capture)
    assert decoder.capture_all() == 1 and decoder._eager_sampling == {"greedy", "sample"}
    got = run(Generator(engine, tok), chat("x"), max_tokens=12, sampling=params)[1].answer_ids
    assert got == want


def test_stream_after_decoder_built_in_inference_mode():
    # the start-up warm-up builds the decoder (its tensors) under inference mode; requests
    # later run outside it
    model = tiny_llama(seed=4)
    engine = TorchEngine(model, ctx_size=256, cuda_graphs=True)
    with torch.inference_mode():
        engine.graph_decoder()
    for params in (SamplingParams(temperature=0), SamplingParams(seed=2)):
        engine.reset()
        gen = Generator(engine, tok)
        text, result = run(gen, chat("x"), max_tokens=8, sampling=params)
        assert len(result.answer_ids) == 8 and engine.n_past == len(gen.held_ids)


@pytest.mark.parametrize("hybrid", [False, True])
def test_warmup_leaves_the_engine_as_a_fresh_one(hybrid):
    # the warm-up's body on the CPU (the static step run eagerly): afterwards greedy and
    # sampled requests, ending at a stop, give what a fresh engine gives
    from test_hybrid_decode import make_model

    from redlite.engine.warmup import warm_up

    model = make_model() if hybrid else tiny_llama(seed=5)
    prompt = chat("warm") if not hybrid else [3, 9, 27, 4, 8, 15]
    outs = []
    for warm in (True, False):
        engine = TorchEngine(model, ctx_size=256, cuda_graphs=True)
        if warm:
            read = []  # the reuse planner's table of token bytes is read by the warm-up

            class Reading(ByteTokenizer):
                def token_bytes(self, token_id):
                    read.append(token_id)
                    return super().token_bytes(token_id)
            report = warm_up(engine, Reading() if not hybrid else None, prefill_chunk=64, devices=("cpu",))
            assert report.skipped is None and report.prefills and engine.n_past == 0
            assert bool(read) != hybrid
        answers = []
        for params in (SamplingParams(temperature=0), SamplingParams(seed=4, top_k=10)):
            engine.reset()
            gen = Generator(engine, tok)
            answer = run(gen, prompt, max_tokens=10, sampling=params)[1].answer_ids
            engine.reset()
            gen = Generator(engine, _Tok(answer[4]))
            result = run(gen, prompt, max_tokens=10, sampling=params)[1]
            assert engine.n_past == len(gen.held_ids)
            answers.append((answer, result.answer_ids, engine.prefill([1]).tolist()))
        outs.append(answers)
    assert outs[0] == outs[1]


# --- a tiny Qwen3.5 hybrid: undo restores the recurrent part -----------------------------------

def test_tiny_hybrid_undo_restores_recurrent_state():
    from test_hybrid_decode import make_model

    model = make_model()
    static = TorchEngine(model, ctx_size=128, cuda_graphs=True)
    eager = TorchEngine(model, ctx_size=128, cuda_graphs=False)
    prompt = [3, 9, 27, 4, 8, 15, 16, 23, 42]
    logits = static.prefill(prompt)
    stream = static.token_stream(SamplingParams(temperature=0), logits)
    held = list(prompt)
    for _ in range(4):
        stream.feed()
        held.append(stream.read())
    stream.feed()
    stream.read()
    stream.undo()  # the last fed token is taken back
    assert static.n_past == len(held)
    torch.testing.assert_close(static.prefill([5, 6]), eager.prefill(held + [5, 6]), rtol=1e-4, atol=1e-4)


# --- the device sampler's distribution ---------------------------------------------------------

def test_device_sampler_filters_and_distribution():
    vocab = 12
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, 3.0]])
    state = DeviceSampling("cpu", vocab)
    out = torch.zeros(1, dtype=torch.long)
    sample_into(logits, out, GREEDY, state)
    assert int(out) == 11

    def draws(params, n=3000):
        state.set(params)
        counts = torch.zeros(vocab)
        for _ in range(n):
            sample_into(logits, out, SAMPLE, state)
            counts[int(out)] += 1
        return counts / n

    assert draws(SamplingParams(top_k=1, seed=1), 50)[11] == 1.0
    assert draws(SamplingParams(top_p=0.01, seed=1), 50)[11] == 1.0
    freq = draws(SamplingParams(temperature=1.0, seed=2))
    want = torch.softmax(logits[0], -1)
    assert (freq - want).abs().max() < 0.03
    freq = draws(SamplingParams(temperature=0.7, top_k=3, seed=3))
    want = torch.softmax(logits[0] / 0.7, -1)
    top = want.topk(3).indices
    want = torch.zeros(vocab).index_copy_(0, top, want[top] / want[top].sum())
    assert (freq - want).abs().max() < 0.03
    freq = draws(SamplingParams(min_p=0.3, seed=4))  # keeps p >= 0.3 p_max: ids 11 and 0
    assert set(freq.nonzero().flatten().tolist()) == {0, 11}



# --- on a GPU: graphs, warm-up ------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_gpu_warmup_captures_every_graph_and_stream_matches_host():
    from redlite.engine.warmup import warm_up

    model = tiny_llama().to("cuda")
    engine = TorchEngine(model, ctx_size=4096, device="cuda")
    report = warm_up(engine, tok, prefill_chunk=512)
    decoder, chunks = engine.graph_decoder(), engine.chunk_graphs()
    assert decoder.n_graphs == 3 * len(decoder.spans) and chunks is not None and chunks.n_graphs > 0
    assert report.graphs == decoder.n_graphs + chunks.n_graphs and engine.n_past == 0
    gen = Generator(engine, tok, GeneratorSettings())
    prompt = chat("hello gpu")
    streamed = run(gen, prompt, max_tokens=48, sampling=SamplingParams(temperature=0))[1]
    assert decoder.n_graphs + chunks.n_graphs == report.graphs  # the request captured nothing
    engine.reset()
    gen = Generator(engine, tok)
    host = run(gen, prompt, max_tokens=48, sampling=SamplingParams(temperature=0, logprobs=0))[1]
    assert streamed.answer_ids == host.answer_ids and len(host.answer_ids) == 48
    outs = []
    for seed in (3, 3):
        engine.reset()
        outs.append(run(Generator(engine, tok), prompt, max_tokens=32, sampling=SamplingParams(seed=seed))[1].answer_ids)
    assert outs[0] == outs[1]


@pytest.mark.gpu
@cuda
def test_gpu_stop_undo_keeps_state_consistent():
    model = tiny_llama(seed=2).to("cuda")
    engine = TorchEngine(model, ctx_size=512, device="cuda")
    eager = TorchEngine(model, ctx_size=512, device="cuda", cuda_graphs=False)
    prompt = chat("stop here")
    answer = run(Generator(engine, tok), prompt, max_tokens=12, sampling=SamplingParams(temperature=0))[1].answer_ids
    engine.reset()
    gen = Generator(engine, _Tok(answer[5]))
    result = run(gen, prompt, max_tokens=40, sampling=SamplingParams(temperature=0))[1]
    assert result.finish_reason == "stop" and engine.n_past == len(gen.held_ids)
    torch.testing.assert_close(engine.prefill([1, 2]), eager.prefill(gen.held_ids + [1, 2]), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@cuda
def test_gpu_hybrid_undo_and_warmup():
    from test_hybrid_decode import make_model

    from redlite.engine.warmup import warm_up

    model = make_model(device="cuda")
    engine = TorchEngine(model, ctx_size=256, device="cuda")
    eager = TorchEngine(model, ctx_size=256, device="cuda", cuda_graphs=False)
    assert warm_up(engine).graphs >= 3
    prompt = [3, 9, 27, 4, 8, 15, 16, 23, 42]
    stream = engine.token_stream(SamplingParams(temperature=0), engine.prefill(prompt))
    held = list(prompt)
    for _ in range(5):
        stream.feed()
        held.append(stream.read())
    stream.feed()
    stream.read()
    stream.undo()
    assert engine.n_past == len(held)
    torch.testing.assert_close(engine.prefill([5, 6]), eager.prefill(held + [5, 6]), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@cuda
def test_gpu_failed_sampling_capture_falls_back_and_leaves_cuda_usable(monkeypatch):
    # a sampling step that reads on the host cannot be captured: the decoder must fall back to
    # sampling after the logits graph with the same output, and leave the default generator and
    # the current stream as they were
    from redlite.engine import cuda_graphs

    model = tiny_llama(seed=5).to("cuda")
    params = SamplingParams(seed=9, top_p=0.9)
    want = run(Generator(TorchEngine(model, ctx_size=512, device="cuda"), tok), chat("x"),
               max_tokens=16, sampling=params)[1].answer_ids
    real = cuda_graphs.sample_into

    def host_reading(logits, out, mode, state):
        real(logits, out, mode, state)
        if torch.cuda.is_current_stream_capturing():
            int(out[0])  # a host read: the capture fails
    monkeypatch.setattr(cuda_graphs, "sample_into", host_reading)
    stream = torch.cuda.current_stream()
    engine = TorchEngine(model, ctx_size=512, device="cuda")
    decoder = engine.graph_decoder()
    with torch.inference_mode():
        decoder.capture_all()
    assert decoder._eager_sampling == {GREEDY, SAMPLE} and torch.cuda.current_stream() == stream
    torch.cuda.manual_seed(1)
    a = torch.randn(8, device="cuda")
    torch.cuda.manual_seed(1)
    assert torch.equal(a, torch.randn(8, device="cuda"))  # the generator still works
    got = run(Generator(engine, tok), chat("x"), max_tokens=16, sampling=params)[1].answer_ids
    assert got == want
