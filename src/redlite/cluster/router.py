"""The Ray Serve request router with conversation affinity (see :mod:`redlite.cluster.affinity`).

Configured on the replica deployment (``RequestRouterConfig(request_router_class=
AffinityRouter, request_router_kwargs={"max_waiting": N})``); one instance lives in each
process holding a handle to the replicas (each ingress replica). The ingress passes the routing
key as the ``affinity_key`` keyword of its call. Ranks are single replicas in the planned
order, so when the preferred replica is full (``max_ongoing_requests``) Ray Serve tries the next.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from redlite.cluster.affinity import AffinityTable, ReplicaLoad, plan_route

log = logging.getLogger("redlite.cluster")

KEY_ARG = "affinity_key"


class AffinityRouter(RequestRouter):
    """Routes each conversation to the replica that served it last (module docstring)."""

    def initialize_state(self, max_waiting: int = 4, remember: int = 100_000, **_) -> None:
        """max_waiting: in-flight requests at which the preferred replica is passed over;
        remember: most conversations remembered."""
        self.max_waiting = max(1, int(max_waiting))
        self.table = AffinityTable(remember)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        return ReplicaLoad(replica.replica_id.unique_id,
                           self._replica_queue_len_cache.get(replica.replica_id))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None,
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.kwargs.get(KEY_ARG) if pending_request is not None else None
        route = plan_route(key, [self._load(r) for r in candidate_replicas],
                           self.table.get(key), self.max_waiting)
        level = logging.DEBUG if route.reason == "remembered" else logging.INFO
        log.log(level, "route %s -> %s (%s)", key, route.preferred, route.reason)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in route.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        """Remember where the conversation went (the fallback, when Ray Serve took one)."""
        self.table.record(pending_request.kwargs.get(KEY_ARG), replica_id.unique_id)
