"""Ray Serve's extension point for routing (`RequestRouter`), applying `router.CheckpointRouting`.

Ray Serve pickles this module by value to ship the class to every deployment handle, so it holds nothing
but the class: shared state lives in `routed` and `router`, which are imported by reference."""

from __future__ import annotations

from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import routed as shared
from .router import CheckpointRouting


class CheckpointRequestRouter(RequestRouter):
    """Replicas' published checkpoints arrive as their routing stats; a replica's load is the requests this
    router has in flight on it. Each decision is recorded (`routed.TELEMETRY`) once Ray has sent the request.
    Without Ray's FIFOMixin: a replica chosen for one request must go to that request, not to whichever
    request is first in the queue."""

    def initialize_state(self, imbalance: int = 4, **kwargs) -> None:
        self.policy = CheckpointRouting(imbalance=imbalance)
        self.inflight: Counter[str] = Counter()
        self.routes: dict = {}  # internal request id -> (Route, Routed), until Ray has sent it
        shared.ROUTERS.add(self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if not hasattr(self, "policy"):
            return
        live = {r.replica_id.unique_id for r in replicas}
        for r in replicas:
            stats = r.routing_stats or {}
            if "checkpoints" in stats:
                self.policy.update(r.replica_id.unique_id, stats["checkpoints"])
        for gone in set(self.policy.published) - live:
            self.policy.drop(gone)

    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(key, shared.Routed):
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if key.target is not None:
            return [[by_id[key.target]]] if key.target in by_id else []
        if key.avoid in by_id and len(by_id) > 1:
            del by_id[key.avoid]
        route = self.policy.choose(key.salt, key.tokens, {r: self.inflight[r] for r in by_id})
        self.routes[pending_request.metadata.internal_request_id] = (route, key)
        holder = route.overloaded
        if holder is not None and route.depths[holder] > route.depth:  # the state may follow the request
            key.fetch_from, key.fetch_tokens = holder, route.depths[holder]
        else:
            key.fetch_from, key.fetch_tokens = None, 0
        # Ray tries the ranks in order and moves on when a replica's queue-length probe fails (as it may on a busy
        # machine): a request sent away from its overloaded holder keeps to its replica, never back to the holder.
        rest = sorted((r for r in by_id if r not in (route.replica, holder)), key=lambda r: self.inflight[r])
        return [[by_id[route.replica]]] + ([[by_id[r] for r in rest]] if rest else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = replica_id.unique_id
        self.inflight[rid] += 1
        self.policy.sent(rid)
        route, key = self.routes.pop(pending_request.metadata.internal_request_id, (None, None))
        if route is None:
            return
        shared.placed(key.request_id, rid)
        shared.TELEMETRY.decided(route, rid, key.request_id, len(key.tokens or ()), retry=key.avoid is not None)
        if key.tokens:
            self.policy.remember(rid, key.salt, key.tokens)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        if self.inflight[rid] > 0:
            self.inflight[rid] -= 1
        self.routes.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.drop(replica_id.unique_id)
        self.inflight.pop(replica_id.unique_id, None)
