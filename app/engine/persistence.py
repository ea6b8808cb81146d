"""Session persistence in Redis: metadata as JSON, tiered KV as raw tensors (never pickle).

A session written here can be resumed by any process that reaches the same Redis: tiered sessions
come back exactly (primary set and cold chunks, loaded at their next turn); other modes come back
with their messages and token ids and re-prefill the history on their next turn.
"""
from __future__ import annotations

import logging
from app.engine.session import Session, TurnStats
from rocketkv_mt.config import RocketKVConfig
from tiers.redis_tier import RedisTier

log = logging.getLogger(__name__)
FORMAT = 1


def persist_session(redis: RedisTier, session: Session) -> bool:
    """Write the session's metadata (and its KV, for tiered sessions); False when Redis is unavailable."""
    cache = session.cache
    kv_state = cache.persist() if cache is not None else None
    meta = {
        "format": FORMAT,
        "id": session.id,
        "mode": session.mode,
        "rocket": session.rocket.model_dump(),
        "messages": session.messages,
        "token_ids": session.token_ids,
        "turns": [vars(t) for t in session.turns],
        "created_at": session.created_at,
        "owner": session.owner,
        "kv": kv_state,
    }
    return redis.put_meta(session.id, meta)


def restore_session(redis: RedisTier, session_id: str) -> Session | None:
    meta = redis.get_meta(session_id)
    if not meta or meta.get("format") != FORMAT or meta.get("id") != session_id:
        return None
    rocket = RocketKVConfig(**meta["rocket"])
    session = Session(
        id=session_id,
        mode=meta["mode"],
        rocket=rocket,
        cache=None,
        messages=list(meta["messages"]),
        token_ids=[int(t) for t in meta["token_ids"]],
        turns=[TurnStats(**t) for t in meta.get("turns", [])],
        created_at=float(meta.get("created_at", 0.0)),
        owner=meta.get("owner"),
    )
    # The KV comes back at the session's next turn, on the model thread and within the device
    # budget (``Engine`` admits the turn first); a record that cannot be restored then means a
    # re-prefill of the history.
    session.parked_kv = meta.get("kv")
    return session


def kv_keys(redis: RedisTier, session_id: str, meta: dict) -> list[str]:
    """The Redis keys the KV state in ``meta`` refers to: each layer's primary set and page index.

    A turn rewrites them at its end-of-turn save; a replica killed before the first save, or a cache
    released after it, leaves some missing, and then the record's KV must not be trusted. (Cold pages
    themselves are never freed while the cache lives; one missing later is a rebuild at read time.)
    """
    kv = meta.get("kv")
    if kv is None:
        return []  # messages and token ids only: the history is re-prefilled anyway
    layers = kv["cold"]
    return [redis.chunk_key(session_id, f"{kind}-l{i}") for i in range(len(layers)) for kind in ("primary", "index")]
