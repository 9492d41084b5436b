"""Routes for operators (issue 21): ``GET /metrics`` (Prometheus text, only with metrics on),
``GET /v1/conversations``, ``GET /slots`` (llama.cpp's shape, one per sequence slot),
``GET /dashboard`` (a static page from the package) and ``GET /dashboard/data`` (its recent
requests, outcomes and reuse totals ``{requests, reused_requests, prompt_tokens,
reused_tokens}`` over first choices; needs metrics on, else empty).

``/v1/conversations``::

    {"object": "list", "data": [{"id", "tier": "live"|"device"|"ram"|"disk", "session_key",
     "tokens", "bytes", "checkpoints": [position, ...], "last_used": epoch s,
     "hits": int | null, "slot": int | null}, ...],
     "tiers": {tier: {"conversations", "tokens", "bytes", "budget_bytes": int | null}}}

Every route sits behind the security middleware (``--api-key``) like the others.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from redlite.server import inventory


def conversations_body(state: Any) -> dict:
    worker = state.worker
    items = inventory.conversations(worker.generators)
    totals = inventory.tier_totals(items)
    budgets = inventory.budgets(worker.generator)
    return {"object": "list", "data": items,
            "tiers": {tier: {"conversations": n, "tokens": tokens, "bytes": nbytes,
                             "budget_bytes": budgets[tier]}
                      for tier, (n, tokens, nbytes) in totals.items()}}


def slots_body(state: Any) -> list[dict]:
    """llama.cpp's ``GET /slots``: one entry per sequence slot (``--parallel``), with its live
    conversation (``hits``: requests that reused its state, redlite's addition)."""
    worker = state.worker
    live = {c["slot"]: c for c in inventory.conversations(worker.generators) if c["tier"] == "live"}
    out = []
    for slot, processing in enumerate(worker.running):
        held = live.get(slot)
        out.append({"id": slot, "id_task": -1, "n_ctx": state.max_context,
                    "is_processing": bool(processing),
                    "n_past": held["tokens"] if held else 0,
                    "checkpoints": held["checkpoints"] if held else [],
                    "hits": held["hits"] if held else 0})
    return out


def _page() -> str:
    return resources.files("redlite.server").joinpath("static/dashboard.html").read_text("utf-8")


def mount_observe_routes(app: FastAPI, state: Any, metrics: Any) -> None:
    """Add the routes (``metrics``: the app's ServerMetrics, None with ``--no-metrics``)."""

    if metrics is not None:
        @app.get("/metrics", response_class=Response)
        async def metrics_route() -> Response:
            body = await asyncio.to_thread(metrics.render)
            return Response(body, media_type=metrics.content_type)

    @app.get("/v1/conversations")
    async def conversations_route() -> dict:
        return conversations_body(state)

    @app.get("/slots")
    async def slots_route() -> list:
        return slots_body(state)

    page = _page()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard_route() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict:
        if metrics is None:
            return {"recent": [], "outcomes": {}, "reuse": {}}
        return {"recent": list(metrics.recent), "outcomes": dict(metrics.outcomes),
                "reuse": dict(metrics.reuse)}
