"""What a replica reports about itself: Redis health for ``/healthz``, totals for ``/metrics`` and ``/v1/stats``.

Read through ``getattr`` with defaults: an engine without tiers (or a test's stand-in) reports zeros.
"""
from __future__ import annotations

import asyncio
from typing import Any

from app.engine.engine import Engine

HEALTH_TIMEOUT_S = 2.0


async def redis_health(engine: Engine, unsaved: int) -> dict[str, Any]:
    """Redis as this replica's one connection sees it (records and KV tier alike); ``{}`` without Redis."""
    tier = getattr(engine, "redis", None)
    if tier is None:
        return {}
    try:  # the ping also clears the connection's error state once Redis answers again
        answered = await asyncio.wait_for(asyncio.to_thread(tier.ping), HEALTH_TIMEOUT_S * 2)
    except Exception:  # noqa: BLE001 - not answering in time is the answer
        answered = False
    error = None if answered else (tier.last_error or "Redis did not answer in time")
    return {"redis": {"ok": error is None, "error": error}, "unsaved_sessions": unsaved}


def replica_totals(engine: Engine, replica: str) -> dict[str, Any]:
    """Totals of this replica: bytes held per tier, entries moved between tiers, and the payload
    bytes each cold tier has served and taken since start (``host_bytes_read``, ...)."""
    totals = {"device_bytes": 0, "host_bytes": 0, "redis_bytes": 0, "promotions": 0, "demotions": 0, "spills": 0}
    sessions = list(engine.sessions.values())
    for session in sessions:
        mem = engine.memory(session)
        for key in ("device_bytes", "host_bytes", "redis_bytes"):
            totals[key] += int(getattr(mem, key, 0) or 0)
    tiers = {"host": getattr(engine, "host_tier", None), "redis": getattr(engine, "redis", None)}
    for name, tier in tiers.items():
        tier_stats = getattr(tier, "stats", None)
        for key in ("promotions", "demotions", "spills"):
            totals[key] += int(getattr(tier_stats, key, 0) or 0)
        for key in ("bytes_read", "bytes_written"):
            totals[f"{name}_{key}"] = int(getattr(tier_stats, key, 0) or 0)
    busy = sum(1 for s in sessions if s.busy)
    # Device budget, peak, parks and refusals, batching figures (Engine.stats).
    return {"replica": replica, "sessions": len(sessions), "busy": busy, **totals, **engine.stats()}
