"""Ray Serve request router that pins every session to one chat replica.

Requests carry their session id as ``multiplexed_model_id``. The replica is chosen by
``app.placement`` (``RKV_PLACEMENT``):
1. a replica that reports holding the session (replicas register the sessions they serve
   through ``@serve.multiplexed``), so sessions stay put when replicas are added; not one that
   reports having let it go since (``released`` in its routing stats: parked off its full device,
   state in Redis), whose next turn is placed as in 2.;
2. otherwise (a new session, or one whose replica died), with ``memory`` the replica that last
   reported the most room (``record_routing_stats``: free device budget, sessions, host room),
   ties by rendezvous hashing of the session id; with ``hash`` the rendezvous hash alone, so every
   router picks the same replica without coordination. Either way a session whose replica died
   moves to a survivor, which restores it from Redis.

Unlike Ray's default multiplex routing, there is no fallback to another replica when the chosen
one is busy: the request waits (with backoff) for it, because serving a turn elsewhere would
mean re-prefilling the whole conversation. Requests without a session id get power-of-two
choices.
"""
from __future__ import annotations

import random
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from app.placement import Candidate, Placer, Policy, Room, holds, place


def replica_key(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def candidates(session_id: str, replicas: list[RunningReplica]) -> list[Candidate]:
    """The replicas as ``app.placement`` sees them: key, whether each holds the session (held and not
    reported released), its room."""
    return [
        Candidate(replica_key(r), holds(session_id, r.multiplexed_model_ids, stats), Room.from_stats(stats))
        for r in replicas
        for stats in [getattr(r, "routing_stats", None)]
    ]


def pick_replica(session_id: str, replicas: list[RunningReplica], policy: Policy = "memory") -> RunningReplica:
    """The replica ``place`` picks, without a router's memory of earlier placements."""
    key = place(session_id, candidates(session_id, replicas), policy).key
    return next(r for r in replicas if replica_key(r) == key)


class SessionAffinityRouter(RequestRouter):
    def initialize_state(self, policy: Policy = "memory", **kwargs) -> None:
        # Called by Serve with ``request_router_kwargs`` (``api.deployment.build_app``).
        self.placer = Placer(policy)

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
        if not hasattr(self, "placer"):  # constructed without ``initialize_state``
            self.placer = Placer()
        key = self.placer.choose(session_id, candidates(session_id, candidate_replicas), time.monotonic())
        return [[r for r in candidate_replicas if replica_key(r) == key]]
