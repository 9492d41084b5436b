"""Prometheus metrics (``GET /metrics``, text format 0.0.4, through ``prometheus-client``).

Per app a :class:`~prometheus_client.CollectorRegistry` of its own (in-process tests build many
apps). Counted once per request, when the access middleware ends it (no per-token work):

- ``redlite_requests_total{route,method,status}``: route is the matched path template
  (``/v1/models/{model_id}``), ``unmatched`` for a 404 outside every route;
- ``redlite_tokens_total{kind}``: kind ``prompt``, ``reused`` (held state kept), ``prefilled``
  (prompt tokens read: prompt - reused, less for a prefill left midway) for each request's
  first choice; ``generated`` for every choice;
- ``redlite_time_to_first_token_seconds`` and ``redlite_time_per_output_token_seconds``
  histograms (TTFT of requests whose prompt was read in full; TPOT = 1 / the decode rate,
  choices with >= 2 tokens);
- ``redlite_cache_misses_total{action,reason}``: reuse plans that were not a plain extension
  (:class:`redlite.core.reuse.ReusePlan`), first choices only.

Read at scrape time from the worker's objects (:mod:`redlite.server.inventory`):
``redlite_conversations{tier}`` (tier ``live``, ``device``, ``ram``, ``disk``: see
:mod:`redlite.server.inventory`), ``redlite_conversation_tokens{tier}``,
``redlite_conversation_bytes{tier}``, ``redlite_tier_budget_bytes{tier}``,
``redlite_queue_depth``, ``redlite_running_sequences``, ``redlite_session_file_refusals_total``.

Observed as conversations move (``Conversations.on_timing``, on the worker thread), histograms
per tier (``_count`` is the number of moves):

- ``redlite_restore_seconds{tier=device|ram|disk}``: a parked conversation brought back into
  the engine (fetch + install), by where it was parked;
- ``redlite_park_seconds{tier=device|ram|disk}``: a conversation parked in device or host
  memory (copy + admission), or written to a session file (``disk``; a file found identical
  counts too).
"""

from __future__ import annotations

from collections import Counter as Tally, deque
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from redlite.server import inventory

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
MOVE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0)
PARK_TIERS = ("device", "ram", "disk")


def route_of(scope: dict) -> str:
    """The matched route's path template, else ``unmatched`` (bounded label values)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class _StateCollector:
    """Gauges and counters read from the server's objects at scrape time."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self):
        worker = self.state.worker
        generator = worker.generator
        items = inventory.conversations(worker.generators)
        totals = inventory.tier_totals(items)
        families = [
            GaugeMetricFamily("redlite_conversations", "Conversations held per tier", labels=["tier"]),
            GaugeMetricFamily("redlite_conversation_tokens", "Tokens held per tier", labels=["tier"]),
            GaugeMetricFamily("redlite_conversation_bytes", "Bytes held per tier", labels=["tier"]),
        ]
        for tier in inventory.TIERS:
            for family, value in zip(families, totals[tier]):
                family.add_metric([tier], value)
        yield from families
        budget = GaugeMetricFamily("redlite_tier_budget_bytes", "Byte budget per tier",
                                   labels=["tier"])
        for tier, value in inventory.budgets(generator).items():
            if value is not None:
                budget.add_metric([tier], value)
        yield budget
        parking = getattr(generator, "parking", None)
        yield GaugeMetricFamily("redlite_queue_depth", "Requests waiting behind the running one",
                                value=worker.queue_depth)
        yield GaugeMetricFamily("redlite_running_sequences", "Sequences being generated",
                                value=sum(worker.running))
        sessions = getattr(parking, "sessions", None)
        yield CounterMetricFamily("redlite_session_file_refusals",
                                  "Session files refused (wrong model, format, checksum)",
                                  value=getattr(sessions, "refusals", 0))


class ServerMetrics:
    """The metrics of one app (see module docstring). ``observe`` runs on the event loop at
    the end of each request; ``render`` answers a scrape."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, state: Any, recent: int = 50) -> None:
        # for the dashboard: the last requests that generated, first choices per outcome
        # (``extend``, or the miss reason), and reuse totals (requests, tokens)
        self.recent: deque = deque(maxlen=recent)
        self.outcomes: Tally = Tally()
        self.reuse: Tally = Tally(requests=0, reused_requests=0, prompt_tokens=0, reused_tokens=0)
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("redlite_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=registry)
        self.tokens = Counter("redlite_tokens", "Tokens by kind", ["kind"], registry=registry)
        self.ttft = Histogram("redlite_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram("redlite_time_per_output_token_seconds", "Time per output token",
                              buckets=TPOT_BUCKETS, registry=registry)
        self.misses = Counter("redlite_cache_misses", "Reuse plans that were not an extension",
                              ["action", "reason"], registry=registry)
        self.restore = Histogram("redlite_restore_seconds", "Parked conversations restored, "
                                 "by the tier they were parked in", ["tier"],
                                 buckets=MOVE_BUCKETS, registry=registry)
        self.park = Histogram("redlite_park_seconds", "Conversations parked, by the tier they "
                              "went to (disk: a session file)", ["tier"], buckets=MOVE_BUCKETS,
                              registry=registry)
        for kind in ("prompt", "reused", "prefilled", "generated"):
            self.tokens.labels(kind)
        for tier in PARK_TIERS:
            self.restore.labels(tier)
            self.park.labels(tier)
        registry.register(_StateCollector(state))
        self.attach(getattr(state.worker.generator, "parking", None))

    def attach(self, parking: Any) -> None:
        """Observe the conversation moves of ``parking`` (a
        :class:`~redlite.core.conversations.Conversations`; None: nothing to observe)."""
        if parking is not None:
            parking.on_timing = self.moved

    def moved(self, kind: str, tier: str, seconds: float) -> None:
        """``Conversations.on_timing``: kind ``restore``, ``park`` or ``save`` (a park to disk)."""
        (self.restore if kind == "restore" else self.park).labels(tier).observe(seconds)

    def observe(self, scope: dict, status: int | None, results: list) -> None:
        """Count one finished request and its generations' results
        (:class:`~redlite.core.generation_request.GenerationResult`)."""
        self.requests.labels(route_of(scope), scope["method"], str(status or 0)).inc()
        for result in results:
            self.tokens.labels("generated").inc(result.completion_tokens)
            if result.completion_tokens >= 2 and result.decode_tokens_per_s > 0:
                self.tpot.observe(1.0 / result.decode_tokens_per_s)
            if result.index:
                continue
            self.tokens.labels("prompt").inc(result.prompt_tokens)
            self.tokens.labels("reused").inc(result.cached_tokens)
            self.tokens.labels("prefilled").inc(result.prefilled_tokens)
            if result.prefill_complete:  # a prefill left midway has no first token
                self.ttft.observe(result.ttft_ms / 1000.0)
            plan = result.plan
            reason = plan.reason.value if plan is not None and plan.reason is not None else None
            if reason is not None:
                self.misses.labels(plan.action.value, reason).inc()
            self.outcomes[reason or "extend"] += 1
            self.reuse.update(requests=1, reused_requests=int(result.cached_tokens > 0),
                              prompt_tokens=result.prompt_tokens,
                              reused_tokens=result.cached_tokens)
            self.recent.append({"route": route_of(scope), "status": status,
                                "prompt": result.prompt_tokens, "reused": result.cached_tokens,
                                "prefilled": result.prefilled_tokens,
                                "generated": result.completion_tokens,
                                "ttft_ms": round(result.ttft_ms, 3), "miss_reason": reason})

    def render(self) -> bytes:
        return generate_latest(self.registry)
