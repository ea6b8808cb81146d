"""Ray Serve request router that pins every session to one chat replica.

Requests carry their session id as ``multiplexed_model_id``. The replica is chosen as:
1. a replica that reports holding the session (replicas register the sessions they serve
   through ``@serve.multiplexed``), so sessions stay put when replicas are added;
2. otherwise, by rendezvous hashing of the session id over the live replicas, so every router
   (one per ingress replica) picks the same replica without coordination, and a session whose
   replica died moves to a deterministic survivor, which restores it from Redis.

Unlike Ray's default multiplex routing, there is no fallback to another replica when the chosen
one is busy: the request waits (with backoff) for it, because serving a turn elsewhere would
mean re-prefilling the whole conversation. Requests without a session id get power-of-two
choices.
"""
from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def rendezvous_score(session_id: str, replica_key: str) -> int:
    digest = hashlib.blake2b(f"{session_id}\0{replica_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def replica_key(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def pick_replica(session_id: str, replicas: list[RunningReplica]) -> RunningReplica:
    holders = [r for r in replicas if session_id in r.multiplexed_model_ids]
    pool = holders or replicas
    return max(pool, key=lambda r: rendezvous_score(session_id, replica_key(r)))


class SessionAffinityRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without this the router retries a busy choice in a tight loop instead of backing off.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        session_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not session_id:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        return [[pick_replica(session_id, candidate_replicas)]]
