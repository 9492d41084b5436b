"""Where one graph-captured decode step of the Qwen3.5 hybrid spends its time, kernel by
kernel, with the bytes each role reads (``bench/hybrid.py --profile-step FILE``, or alone with
random weights and no transformers model, which builds in seconds).

Usage::

    PYTHONPATH=src python3 bench/hybrid_profile.py --shape 35b-a3b --contexts 1024,8192 --out DIR
    PYTHONPATH=src python3 bench/hybrid_profile.py --shape 35b-a3b --search-gemv --out DIR

How a step is attributed:

* an eager step (plain launches, no PDL) runs under torch.profiler with every decode op in a
  ``record_function`` range; each kernel is matched to its op through the launch's
  correlation id, and the op's weight gives the kernel a role (``gdn.in_proj``, ``lm_head``,
  ``moe.gate_up``, ...) and a byte count. Its durations are each kernel alone.
* the captured graph (PDL as the engine runs it) is replayed under the profiler; its kernels
  come in the eager step's order, so they take the same roles. With PDL a kernel starts
  before the previous one ends, so its duration overlaps its neighbours'; a kernel's share
  of the step is the time from the previous kernel's end to its own end (the shares add up
  to the step, first kernel start to last kernel end).
* the launch: the host time of ``replay()`` and, profiled, how long after the launch call
  began the first kernel started; and the same step captured with plain launches (no PDL
  edges), its time and launch cost.
* ``--search-gemv``: the whole step's graph time (CUDA events, no profiler) with each
  candidate launch setting of each matrix-vector shape of the model, one shape at a time
  (the others at the table's setting), then with the best of each together, then with each
  candidate of ``KERNEL_GLOBALS`` (MoE and Gated DeltaNet step settings) on top. One graph at
  a time, so slow drift between measurements counts as a difference: confirm a winner by
  alternating replays of both graphs.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

MOE_KERNELS = {"_gemv_kernel": "moe.router", "_route_kernel": "moe.route", "_gate_up_kernel": "moe.gate_up",
               "_down_kernel": "moe.down"}


def random_model(config: dict, device: torch.device, dtype: torch.dtype, router_spread: float = 8.0):
    """A ``Qwen3_5Model`` of ``config`` on ``device`` with random weights (normal, std 0.02;
    norms 0, i.e. scale 1 in the zero-centred form; ``A_log`` log of U(1, 16), ``dt_bias``
    1; router rows std ``0.02 * router_spread`` so the top-k is not near-tied)."""
    from redlite.models.qwen3_5 import Qwen3_5Model

    model = Qwen3_5Model(config, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.zero_()
            elif name.endswith("A_log"):
                p.uniform_(1.0, 16.0, generator=gen).log_()
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 * (router_spread if name.endswith("gates_weight") else 1.0), generator=gen)
    return model.eval()


def roles(model) -> dict[int, tuple[str, int]]:
    """id(weight) -> (role, bytes read) for the decode step's matrix-vector products."""
    table = {id(model.lm_head_weight): ("lm_head", model.lm_head_weight.nbytes)}
    for layer in model.layers:
        if layer.layer_type == "linear_attention":
            m = layer.linear_attn
            table[id(m.in_proj_weight)] = ("gdn.in_proj", m.in_proj_weight.nbytes)
            table[id(m.out_weight)] = ("gdn.out_proj", m.out_weight.nbytes)
        else:
            a = layer.self_attn
            table[id(a.qkv_weight)] = ("attn.qkv", a.qkv_weight.nbytes)
            table[id(a.o_weight)] = ("attn.o_proj", a.o_weight.nbytes)
    return table


def moe_bytes(moe) -> dict[str, int]:
    """Bytes each MoE kernel role reads from weights for one token."""
    k, esize = moe.top_k, moe.gate_up_weight.element_size()
    return {"moe.router": moe.gates_weight.nbytes, "moe.route": 0,
            "moe.gate_up": k * moe.gate_up_weight[0].numel() * esize + moe.shared.gate_up_weight.nbytes,
            "moe.down": k * moe.down_weight[0].numel() * esize + moe.shared.down_weight.nbytes}


class Recorder:
    """Decode ops that put every call in a ``record_function`` range ``op<i>`` and log its
    role(s) and bytes: ``self.calls[i] = (op name, {kernel name or '*': (role, bytes)})``."""

    def __init__(self, ops, model, ctx: int):
        self.ops, self.roles, self.ctx, self.calls = ops, roles(model), ctx, []

    def __getattr__(self, name):
        fn = getattr(self.ops, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            self.calls.append((name, self._describe(name, args)))
            with torch.profiler.record_function(f"op{len(self.calls) - 1}"):
                return fn(*args, **kwargs)
        return call

    def _describe(self, name, args) -> dict:
        if name in ("norm_linear", "linear_residual"):
            weight = args[3] if name == "norm_linear" else args[1]
            return {"*": self.roles.get(id(weight), (name, weight.nbytes))}
        if name == "gdn_step":
            conv, rec = args[1], args[2]
            return {"*": ("gdn.step", 2 * (conv.nbytes + rec.nbytes))}
        if name == "gated_rope_attend":
            keys = args[7]
            kv = 2 * keys.shape[0] * (self.ctx + 1) * keys.shape[2] * keys.element_size()
            return {"*": ("attn.attend", kv)}
        if name == "moe":
            sizes = moe_bytes(args[3])
            return {kernel: (role, sizes[role]) for kernel, role in MOE_KERNELS.items()}
        return {"*": (name, 0)}


def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()).get("traceEvents", [])


def kernels_of(events) -> list[dict]:
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def eager_roles(model, state, ctx, device, dtype) -> list[dict]:
    """One eager step (plain launches) under the profiler: its kernels in order, each with
    name, role, bytes (of the role, split evenly over an op's kernels of that role) and
    duration in us."""
    from redlite.layers import decode_ops as dops

    cfg = model.text_config
    ops = dops.decode_ops(device, dtype, cfg["head_dim"], cfg["num_key_value_heads"], model.linear, pdl=0)
    rec = Recorder(ops, model, ctx)
    token = torch.ones(1, dtype=torch.long, device=device)
    pos = torch.full((1,), ctx, dtype=torch.long, device=device)
    with torch.inference_mode():
        for _ in range(2):  # compile, warm
            model.decode_step(token, pos, state, state.max_tokens, ops)
        torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.decode_step(token, pos, state, state.max_tokens, rec)
            torch.cuda.synchronize(device)
    events = trace_events(prof)
    ranges = sorted(((e["ts"], e["ts"] + e["dur"], int(e["name"][2:])) for e in events
                     if e.get("cat") == "user_annotation" and e.get("name", "").startswith("op")
                     and e["name"][2:].isdigit()))
    launch_op = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and corr is not None:
            for start, end, i in ranges:
                if start <= e["ts"] <= end:
                    launch_op[corr] = i
    gpu_ranges = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"][2:])) for e in events
                        if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("op")
                        and e["name"][2:].isdigit())
    rows = []
    for k in kernels_of(events):
        i = launch_op.get((k.get("args") or {}).get("correlation"))
        if i is None:  # no launch event recorded: the GPU-side range of the op
            i = next((j for start, end, j in gpu_ranges if start <= k["ts"] and k["ts"] + k["dur"] <= end), None)
        name = k["name"]
        if i is None:
            role, nbytes = ("other", 0)
        else:
            described = rec.calls[i][1]
            role, nbytes = next((v for key, v in described.items() if name.startswith(key)),
                                described.get("*", ("other", 0)))
        rows.append({"name": name, "role": role, "bytes": nbytes, "op": i, "dur": k["dur"]})
    # an op of several kernels of one role (attention: attend + combine) shares its bytes
    count = collections.Counter((r["op"], r["role"]) for r in rows)
    for r in rows:
        r["bytes"] = r["bytes"] / count[(r["op"], r["role"])] if r["bytes"] else 0
    return rows


def capture(model, state, ctx, device, ops):
    token = torch.ones(1, dtype=torch.long, device=device)
    pos = torch.full((1,), ctx, dtype=torch.long, device=device)
    with torch.inference_mode():
        model.decode_step(token, pos, state, state.max_tokens, ops)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.decode_step(token, pos, state, state.max_tokens, ops)
    return graph


def graph_ms(graph, device, reps: int = 40) -> float:
    """Median ms of one replay (CUDA events), after 3 warm replays."""
    from gpu_tune import replay_ms

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    return replay_ms(graph, reps)


def graph_shares(graph, n_kernels: int, device, reps: int = 10) -> tuple[list[list[dict]], list[dict]]:
    """Kernels of ``reps`` profiled replays: per replay, per kernel ``dur`` and ``share`` (us
    from the previous kernel's end to this one's end; the first: its whole duration); and per
    replay the launch: the host call's duration and the first kernel's start after the call
    began (us)."""
    graph.replay()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            torch.cuda.synchronize(device)
    events = trace_events(prof)
    ks = kernels_of(events)
    calls = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and "GraphLaunch" in e.get("name", "")), key=lambda e: e["ts"])
    steps, launches = [], []
    for r in range(len(ks) // n_kernels):
        chunk = ks[r * n_kernels:(r + 1) * n_kernels]
        prev_end = chunk[0]["ts"]
        rows = []
        for k in chunk:
            end = k["ts"] + k["dur"]
            rows.append({"name": k["name"], "dur": k["dur"], "share": end - prev_end, "start_gap": k["ts"] - prev_end})
            prev_end = max(prev_end, end)
        steps.append(rows)
        if r < len(calls):
            launches.append({"call_us": calls[r]["dur"], "first_kernel_after_call_us": chunk[0]["ts"] - calls[r]["ts"],
                             "span_us": prev_end - chunk[0]["ts"]})
    return steps, launches


def host_replay_us(graph, device, reps: int = 20) -> float:
    """Median host time of the ``replay()`` call itself (the queue drained before each)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def _med(rows, key) -> float:
    values = [r[key] for r in rows]
    return statistics.median(values) if values else float("nan")


def profile_step(model, state, ctx: int, device, dtype, bw: float | None, say=print) -> dict:
    """The tables of the module docstring at context ``ctx`` (KV rows 0..ctx random);
    returns them as a dict (``markdown`` lines under ``"md"``)."""
    from redlite.layers import decode_ops as dops

    with torch.inference_mode():
        state.cache.data[:, :, :, :ctx].normal_()
    state.n_past = ctx
    eager = eager_roles(model, state, ctx, device, dtype)
    cfg = model.text_config
    ops = dops.decode_ops(device, dtype, cfg["head_dim"], cfg["num_key_value_heads"], model.linear)
    graph = capture(model, state, ctx, device, ops)
    step_ms = graph_ms(graph, device)
    steps, launches = graph_shares(graph, len(eager), device)
    host_us = host_replay_us(graph, device)
    ok = [s for s in steps if [k["name"] for k in s] == [k["name"] for k in eager]]
    result = {"context": ctx, "graph_ms": step_ms, "ops": ops.name, "kernels_per_step": len(eager),
              "profiled_replays": len(steps), "matching_replays": len(ok), "roles": [], "launches": launches,
              "host_replay_us": host_us}
    by_role = collections.OrderedDict()
    for j, k in enumerate(eager):
        r = by_role.setdefault(k["role"], {"role": k["role"], "kernels": 0, "bytes": 0.0, "eager_us": 0.0,
                                           "share_us": 0.0, "names": set()})
        r["kernels"] += 1
        r["bytes"] += k["bytes"]
        r["eager_us"] += k["dur"]
        r["names"].add(k["name"])
        if ok:
            r["share_us"] += statistics.median(s[j]["share"] for s in ok)
    total_share = sum(r["share_us"] for r in by_role.values())
    total_bytes = sum(r["bytes"] for r in by_role.values())
    lines = [f"### decode step at context {ctx}: graph {step_ms:.3f} ms (CUDA events), ops {ops.name}, "
             f"{len(eager)} kernels; {total_bytes / 1e9:.3f} GB counted; profiled shares add to "
             f"{total_share / 1e3:.3f} ms ({len(ok)}/{len(steps)} replays in the eager order)", "",
             f"launch: replay() call {host_us:.1f} us on the host (queue empty); profiled: call "
             f"{_med(launches, 'call_us'):.1f} us, first kernel {_med(launches, 'first_kernel_after_call_us'):.1f} us "
             f"after the call began, kernel span {_med(launches, 'span_us'):.1f} us", "",
             "| role | kernels | GB | alone us | alone TB/s | share us | share TB/s | % of step | "
             "share at copy bw us | excess us |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(by_role.values(), key=lambda r: -r["share_us"]):
        ideal = r["bytes"] / bw * 1e6 if bw else float("nan")
        r["names"] = sorted(r["names"])
        r["ideal_us"] = ideal
        tb = lambda us: r["bytes"] / us / 1e6 if us else float("nan")  # noqa: E731
        lines.append(f"| {r['role']} ({', '.join(r['names'])}) | {r['kernels']} | {r['bytes'] / 1e9:.3f} | "
                     f"{r['eager_us']:.1f} | {tb(r['eager_us']):.2f} | {r['share_us']:.1f} | {tb(r['share_us']):.2f} | "
                     f"{100 * r['share_us'] / total_share if total_share else 0:.1f} | {ideal:.1f} | "
                     f"{r['share_us'] - ideal:.1f} |")
        result["roles"].append(r)
    # the kernels of the first GDN layer, the first attention layer and the lm_head, in order
    if ok:
        lines += ["", "first GDN layer, first attention layer, lm_head: kernel by kernel (median replay, us):", ""]
        n_layers = len(model.layers)
        first = {t: model.layer_types.index(t) for t in set(model.layer_types)}
        wanted = {None, 4 * n_layers} | {4 * i + j for i in first.values() for j in range(4)}
        for j, k in enumerate(eager):
            if k["op"] in wanted:
                lines.append(f"- op {k['op']}: {k['role']:<14} {k['name']:<28} share "
                             f"{statistics.median(s[j]['share'] for s in ok):6.2f}  alone {k['dur']:6.2f}  "
                             f"start after previous end {statistics.median(s[j]['start_gap'] for s in ok):6.2f}")
    del graph
    # the launch cost of the same step captured with plain launches (no PDL edges)
    plain = capture(model, state, ctx, device, dops.decode_ops(device, dtype, cfg["head_dim"],
                                                                cfg["num_key_value_heads"], model.linear, pdl=0))
    result["plain_graph_ms"], result["plain_host_replay_us"] = graph_ms(plain, device), host_replay_us(plain, device)
    del plain
    lines[2:2] = [f"the same step captured without PDL: graph {result['plain_graph_ms']:.3f} ms, replay() call "
                  f"{result['plain_host_replay_us']:.1f} us on the host", ""]
    result["md"] = lines
    for line in lines:
        say(line)
    return result


GEMV_CANDIDATES = {  # per role: (block_n, block_k, num_warps, num_stages, programs_per_sm)
    "gdn.in_proj": [(4, 2048, 8, 1, 4), (8, 2048, 8, 1, 2), (2, 2048, 4, 1, 4), (8, 1024, 8, 1, 2),
                    (4, 1024, 4, 1, 4), (2, 2048, 4, 1, 8)],
    "attn.qkv": [(4, 2048, 8, 1, 4), (8, 2048, 8, 1, 2), (2, 2048, 4, 1, 4), (2, 2048, 4, 1, 8)],
    "lm_head": [(4, 2048, 8, 1, 4), (8, 2048, 8, 1, 2), (2, 2048, 4, 1, 8), (8, 2048, 8, 1, 4), (4, 2048, 4, 1, 4)],
    "gdn.out_proj": [(4, 4096, 8, 1, 0), (8, 4096, 8, 1, 0), (2, 4096, 4, 1, 4), (8, 1024, 4, 1, 4),
                     (2, 4096, 4, 1, 0), (4, 2048, 8, 1, 2)],
    "attn.o_proj": [(4, 4096, 8, 1, 0), (8, 4096, 8, 1, 0), (2, 4096, 4, 1, 4), (8, 1024, 4, 1, 4)],
    "moe.router": [(1, 2048, 4, 1, 0), (2, 2048, 4, 1, 0), (1, 2048, 2, 1, 0), (4, 2048, 4, 1, 0)],
}


def gemv_shapes(model) -> dict[str, tuple[int, int, int]]:
    """(mode, rows, k) of each matrix-vector role of the decode step (mode as triton_gemv)."""
    from redlite.layers import triton_gemv as tg

    shapes = {"lm_head": (tg.PLAIN, *model.lm_head_weight.shape)}
    for layer in model.layers:
        if layer.layer_type == "linear_attention":
            m = layer.linear_attn
            shapes["gdn.in_proj"] = (tg.PLAIN, *m.in_proj_weight.shape)
            shapes["gdn.out_proj"] = (tg.RESIDUAL, *m.out_weight.shape)
        else:
            a = layer.self_attn
            shapes["attn.qkv"] = (tg.PLAIN, *a.qkv_weight.shape)
            shapes["attn.o_proj"] = (tg.RESIDUAL, *a.o_weight.shape)
        if layer.moe:
            shapes["moe.router"] = (tg.PLAIN, *layer.mlp.gates_weight.shape)
    return shapes


def search_gemv(model, state, ctx: int, device, dtype, say=print, budget_s: float = 90.0) -> dict:
    """Whole-step graph ms per candidate setting of each GEMV shape (others at the table's),
    then the best of each together; returns rows and the best table."""
    from redlite.layers import decode_ops as dops
    from redlite.layers import triton_gemv as tg

    cfg = model.text_config
    state.n_past = ctx
    shapes = gemv_shapes(model)
    base = {shape: tg.gemv_config(*shape) for shape in shapes.values()}
    started = time.perf_counter()

    def step_ms(table):
        ops = dops.decode_ops(device, dtype, cfg["head_dim"], cfg["num_key_value_heads"], model.linear)
        ops.configs = table
        graph = capture(model, state, ctx, device, ops)
        ms = graph_ms(graph, device)
        del graph
        return ms

    rows = [{"variant": "table", "ms": step_ms(dict(base))}]
    say(f"gemv search @ {ctx}: table settings {rows[0]['ms']:.4f} ms")
    best = dict(base)
    for role, shape in shapes.items():
        cands = GEMV_CANDIDATES.get(role, [])
        top = (rows[0]["ms"], base[shape])
        for cand in cands:
            if time.perf_counter() - started > budget_s:
                break
            cand = (cand[0], min(cand[1], 1 << (shape[2] - 1).bit_length()), *cand[2:])
            if cand == base[shape]:
                continue
            try:
                ms = step_ms({**base, shape: cand})
            except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit
                say(f"gemv search {role} {cand}: {type(error).__name__}: {str(error)[:100]}")
                continue
            rows.append({"variant": role, "shape": shape, "config": cand, "ms": ms})
            say(f"gemv search @ {ctx}: {role:<12} {cand}: {ms:.4f} ms")
            if ms < top[0]:
                top = (ms, cand)
        best[shape] = top[1]
    rows.append({"variant": "table", "ms": step_ms(dict(base))})
    rows.append({"variant": "best of each", "ms": step_ms(dict(best))})
    say(f"gemv search @ {ctx}: table again {rows[-2]['ms']:.4f} ms, best of each {rows[-1]['ms']:.4f} ms "
        f"({ {role: best[s] for role, s in shapes.items()} })")
    rows += search_globals(lambda: step_ms(dict(best)), say, started, budget_s + 45.0)
    return {"rows": rows, "best": {",".join(map(str, s)): best[s] for s in shapes.values()},
            "roles": {role: list(s) for role, s in shapes.items()}}


KERNEL_GLOBALS = [  # (module, name, candidates): other kernels' settings, tried in the whole step
    ("triton_moe", "DOWN_CONFIG", [(2, 512, 2), (1, 512, 2), (2, 512, 4), (4, 512, 4), (1, 256, 2)]),
    ("triton_moe", "GATE_UP_CONFIG", [(2, 2048, 4, 3), (4, 2048, 4, 2), (1, 2048, 4, 8)]),
    ("triton_gdn", "GDN_BLOCK_V", [16, 128]),
    ("triton_gdn", "GDN_WARPS", [1, 2]),
]


def search_globals(step_ms, say, started: float, deadline_s: float) -> list[dict]:
    """Whole-step ms with each candidate of ``KERNEL_GLOBALS`` (one at a time, the module's
    setting restored after)."""
    import importlib

    rows = [{"variant": "globals base", "ms": step_ms()}]
    say(f"globals base {rows[0]['ms']:.4f} ms")
    for module_name, name, cands in KERNEL_GLOBALS:
        module = importlib.import_module(f"redlite.layers.{module_name}")
        old = getattr(module, name)
        for cand in cands:
            if time.perf_counter() - started > deadline_s:
                break
            setattr(module, name, cand)
            try:
                ms = step_ms()
            except Exception as error:  # noqa: BLE001
                say(f"{name} {cand}: {type(error).__name__}: {str(error)[:100]}")
                continue
            finally:
                setattr(module, name, old)
            rows.append({"variant": f"{module_name}.{name}", "config": cand, "ms": ms})
            say(f"{module_name}.{name} = {cand}: {ms:.4f} ms")
    rows.append({"variant": "globals base again", "ms": step_ms()})
    say(f"globals base again {rows[-1]['ms']:.4f} ms")
    return rows


#: the GEMV table entries added for the 35B-A3B shapes (moe37): ``--ab-before`` drops them
ADDED_ENTRIES = ((0, 12352, 2048), (0, 9216, 2048), (0, 248320, 2048))


def ab_decode(model, ctx: int, device, dtype, variants: dict, rounds: int = 4, tokens: int = 64,
              say=print) -> dict:
    """Greedy decode ms per token (bench/gpu.py's loop: the engine's graph, the greedy id read on
    the host every step) at context ``ctx`` with engines built under each variant (name ->
    function that patches the kernel settings and returns an undo function), runs alternated
    ``rounds`` times. Returns name -> list of ms per token."""
    from redlite.engine.torch_engine import TorchEngine

    engines = {}
    for name, patch in variants.items():
        undo = patch()
        try:
            engine = TorchEngine(model, ctx_size=ctx + tokens + 64, device=device, dtype=dtype)
            with torch.inference_mode():
                engine.state.cache.data[:, :, :, :ctx].normal_()
            engine.state.n_past = ctx
            engine.decode(1)  # captures the graph under the patched settings
        finally:
            undo()
        engines[name] = engine
    times = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            engine.state.n_past = ctx
            logits = engine.decode(1)
            for _ in range(3):
                logits = engine.decode(int(torch.argmax(logits)))
            engine.state.n_past = ctx
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(tokens):
                logits = engine.decode(int(torch.argmax(logits)))
            int(torch.argmax(logits))
            times[name].append((time.perf_counter() - t0) / tokens * 1e3)
    for name, t in times.items():
        say(f"decode A/B @ {ctx}: {name:<8} median {statistics.median(t):.4f} ms/token  "
            f"({' '.join(f'{x:.4f}' for x in t)})")
    del engines
    torch.cuda.empty_cache()
    return times


def without_added_entries():
    """Patch: the GEMV table without ``ADDED_ENTRIES`` (those shapes back on DEFAULT_CONFIG)."""
    from redlite.layers import triton_gemv as tg

    saved = {key: tg.GEMV_CONFIGS.pop(key) for key in ADDED_ENTRIES if key in tg.GEMV_CONFIGS}
    return lambda: tg.GEMV_CONFIGS.update(saved)


def main() -> None:
    from hybrid_report import SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="35b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--search-gemv", action="store_true")
    parser.add_argument("--search-budget", type=float, default=90.0, help="seconds for the GEMV search at most (45 more for the other kernels)")
    parser.add_argument("--ab-before", action="store_true",
                        help="only the decode loop with and without ADDED_ENTRIES, alternated (no profile)")
    parser.add_argument("--out", help="folder for profile.md / profile.json")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    src = torch.empty(1 << 30, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        dst.copy_(src)
    e.record()
    e.synchronize()
    bw = 10 * 2 * src.nbytes / (s.elapsed_time(e) / 1e3)
    del src, dst
    model = random_model(SHAPES[args.shape], device, dtype)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    state = model.new_state(max(contexts) + 64, device, dtype)
    print(f"built in {time.perf_counter() - t0:.1f} s; copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    out = {"copy_bw_Bps": bw, "shape": args.shape, "profiles": [], "search": None}
    md = [f"copy bandwidth {bw / 1e12:.3f} TB/s", ""]
    if args.ab_before:
        out["ab"] = {}
        for ctx in contexts:
            out["ab"][str(ctx)] = ab_decode(model, ctx, device, dtype, {"before": without_added_entries,
                                                                        "after": lambda: (lambda: None)},
                                            say=lambda m: print(m, flush=True))
            md.append(f"decode A/B @ {ctx}: " + ", ".join(f"{n} {statistics.median(t):.4f} ms/token"
                                                           for n, t in out["ab"][str(ctx)].items()))
        contexts = []
    for ctx in contexts:
        try:
            res = profile_step(model, state, ctx, device, dtype, bw, say=lambda m: print(m, flush=True))
            md += res.pop("md") + [""]
            out["profiles"].append(res)
        except Exception as error:  # noqa: BLE001 - report and go on
            print(f"profile @ {ctx}: {type(error).__name__}: {error}", flush=True)
    if args.search_gemv:
        out["search"] = search_gemv(model, state, contexts[0], device, dtype, say=lambda m: print(m, flush=True),
                                    budget_s=args.search_budget)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.json").write_text(json.dumps(out, indent=1, default=str))
        (Path(args.out) / "profile.md").write_text("\n".join(md) + "\n")
    print(f"done in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
