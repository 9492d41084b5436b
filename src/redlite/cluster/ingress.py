"""The HTTP ingress of the cluster: reads each request, computes its conversation key
(:func:`redlite.cluster.affinity.conversation_key`) and forwards it to a replica through a
Ray Serve handle whose router (:class:`redlite.cluster.router.AffinityRouter`, or Ray Serve's
default) picks the replica; the replica's response streams back unchanged (status, headers,
SSE events as they come). A replica that fails before answering gives a 503 (``Retry-After``)
in the surface's error shape. The ingress holds no model: it is cheap to run several.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from redlite.cluster.affinity import conversation_key
from redlite.cluster.replica import ForwardedRequest
from redlite.cluster.router import KEY_ARG
from redlite.server.errors import error_response, surface_of

log = logging.getLogger("redlite.cluster")

# Ray Serve's proxy adds its own x-request-id: the replica's (the id in its logs and error
# bodies) is passed on under another name rather than as a second value.
REQUEST_ID_RENAMES = {"x-request-id": "x-redlite-request-id"}


def _json_object(body: bytes) -> dict | None:
    """The body as a JSON object, or None (the replica answers malformed bodies)."""
    try:
        value = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


async def _rest(stream) -> AsyncIterator[bytes]:
    """The body chunks after the (status, headers) item; a replica failing mid-stream ends
    the stream there (the status is already sent)."""
    async for chunk in stream:
        yield chunk


class Ingress:
    """Ray Serve ingress deployment (wrapped in :func:`redlite.cluster.app.build_app`).
    ``replicas``: the handle of the replica deployment; ``log_level``: ``--log-level`` (the
    router's route lines are logged here, in the ingress's process)."""

    def __init__(self, replicas, log_level: str = "info") -> None:
        logging.basicConfig(level=log_level.upper())
        self.replicas = replicas.options(method_name="handle", stream=True)

    async def __call__(self, request: Request) -> StreamingResponse:
        body = await request.body()
        headers = [(k.lower(), v) for k, v in request.headers.items()]
        key = conversation_key(dict(headers), request.url.path, _json_object(body))
        client = (request.client.host, request.client.port) if request.client else None
        forwarded = ForwardedRequest(request.method, request.url.path,
                                     request.url.query.encode("latin-1"), headers, body, client)
        stream = self.replicas.remote(forwarded, **{KEY_ARG: key.value if key else None})
        try:
            status, response_headers = await stream.__anext__()
        except Exception:  # the replica died or was removed under the request
            log.warning("no replica answered %s %s", request.method, request.url.path,
                        exc_info=True)
            return error_response(503, "no replica could take the request; retry",
                                  code="replica_unavailable", headers={"Retry-After": "1"},
                                  surface=surface_of(request.url.path))
        response = StreamingResponse(_rest(stream), status_code=status)
        response.raw_headers = [(REQUEST_ID_RENAMES.get(k, k).encode("latin-1"),
                                 v.encode("latin-1")) for k, v in response_headers]
        return response
