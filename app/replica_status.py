"""What a replica reports about itself: Redis health for ``/healthz``, totals for ``/metrics`` and ``/v1/stats``.

Both read counters and states that their owners keep up to date (no walk over sessions' keys, no call
that can hang): ``/healthz`` waits at most ``HEALTH_WAIT_S`` for Redis, and not at all while its circuit
is open. Read through ``getattr`` with defaults: an engine without tiers (or a test's stand-in) reports
zeros.
"""
from __future__ import annotations

import time
from typing import Any

from app.engine.engine import Engine
from app.placement import Room

HEALTH_WAIT_S = 0.5  # a health probe with a 1-second timeout still hears "degraded" from a hung Redis
# A session idle for longer is counted as room: the engine parks the longest idle first, and a chat's next
# turn mostly comes within minutes (80% of a to-C trace's KV reuses within 10 minutes: Wang et al. 2025,
# "KVCache Cache in the Wild", arXiv 2506.02634), most after tens of seconds.
ACTIVE_S = 300.0


async def redis_health(engine: Engine, unsaved: int, refusal: str | None = None) -> dict[str, Any]:
    """Redis as this replica's one connection sees it (records and KV tier alike), or why it takes no saves
    (``refusal``: an evicting policy found after a reconnect); ``{}`` without Redis."""
    tier = getattr(engine, "redis", None)
    if tier is None:
        return {}
    error = await tier.client.check(HEALTH_WAIT_S)  # its answer also closes or opens the circuit
    error = error or refusal
    return {"redis": {"ok": error is None, "error": error}, "unsaved_sessions": unsaved}


def replica_totals(engine: Engine, replica: str) -> dict[str, Any]:
    """Totals of this replica: bytes held per tier, entries moved between tiers, the payload bytes each
    cold tier has served and taken since start (``host_bytes_read``, ...), and the Redis circuit."""
    sessions = list(engine.sessions.values())
    tiers = {"host": getattr(engine, "host_tier", None), "redis": getattr(engine, "redis", None)}
    totals = {"device_bytes": 0, "promotions": 0, "demotions": 0, "spills": 0}
    for session in sessions:
        cache = session.cache
        totals["device_bytes"] += cache.device_bytes() if cache is not None else 0
    for name, tier in tiers.items():
        tier_stats = getattr(tier, "stats", None)
        totals[f"{name}_bytes"] = int(getattr(tier_stats, "bytes", 0) or 0)  # the tier's own counter
        for key in ("promotions", "demotions", "spills"):
            totals[key] += int(getattr(tier_stats, key, 0) or 0)
        for key in ("bytes_read", "bytes_written"):
            totals[f"{name}_{key}"] = int(getattr(tier_stats, key, 0) or 0)
    client = getattr(tiers["redis"], "client", None)
    circuit = client.circuit() if client is not None else {}  # every circuit's (one per shard on a cluster)
    if client is not None:
        circuit["redis_round_trips"] = client.calls  # records and KV alike: a pipeline is one
    busy = sum(1 for s in sessions if s.busy)
    # Device budget, peak, parks and refusals, host-tier bound and refusals, batching figures (Engine.stats).
    return {"replica": replica, "sessions": len(sessions), "busy": busy, **totals, **circuit, **engine.stats()}


def replica_room(engine: Engine, max_sessions: int | None, now: float | None = None) -> Room:
    """This replica's room for new sessions (``app.placement.Room``): its device budget less what turns
    in flight reserve and what sessions active within ``ACTIVE_S`` hold; host-tier bytes free; sessions."""
    now = time.time() if now is None else now
    mem = engine.memory_account
    sessions = list(engine.sessions.values())
    taken, active = 0, 0
    for session in sessions:
        nbytes = max(mem.held.get(session.id, 0), mem.reserved.get(session.id, 0))
        if nbytes and (session.busy or session.id in mem.reserved or now - session.last_used < ACTIVE_S):
            taken += nbytes
            active += 1
    host = getattr(getattr(engine, "host_memory", None), "tier", None)
    return Room(
        device_room=mem.budget - taken if mem.budget else None,
        host_free=host.free_bytes() if host is not None else None,
        sessions=len(sessions),
        session_slots=None if max_sessions is None else max(0, max_sessions - len(sessions)),
        session_bytes=taken // active if active else 0,
        reported_at=now,
    )
