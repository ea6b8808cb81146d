"""What Redis is set up to promise: whether it may evict keys, and whether a write it acknowledged survives its
own crash. Read at start and again whenever Redis answers after failing (a restart, a failover), from every primary.

A session's record, and the KV it names, must not be evicted: under any evicting ``maxmemory-policy``
(the ``volatile-*`` ones included, since every key here has a TTL) a record or a page could vanish while
a client was told it was saved. Such a Redis is refused unless the operator allows it
(``RKV_REDIS_ALLOW_EVICTION``). ``appendfsync always`` makes every acknowledged write survive a
crash of the primary; anything less may lose the last second (``everysec``) or more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

# What a turn's save can promise, weakest first (``Done.storage.durability``).
FSYNC_ORDER = ("unknown", "off", "no", "everysec", "always")


class EvictingRedis(RuntimeError):
    """Redis may evict keys: sessions could be lost after being acknowledged as saved."""


@dataclass(frozen=True)
class StoreConfig:
    policy: str = "unknown"  # maxmemory-policy ("unknown" when CONFIG is not allowed, as on managed Redis)
    fsync: str = "unknown"  # appendfsync, or "off" without AOF

    evicting = property(lambda self: self.policy not in ("noeviction", "unknown"))
    fsync_always = property(lambda self: self.fsync == "always")

    def refusal(self) -> str | None:
        """Why this Redis must not hold sessions, or None."""
        return None if not self.evicting else (
            f"Redis evicts keys under memory pressure (maxmemory-policy {self.policy}): an acknowledged session could "
            "vanish. Set `maxmemory-policy noeviction` on every primary, or allow it knowingly with "
            "RKV_REDIS_ALLOW_EVICTION=true.")


def _decoded(reply: dict) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in reply.items()}


def _per_node(reply: Any, cluster: bool) -> list[dict]:  # a cluster maps each primary to its own answer
    return list(reply.values()) if cluster and reply and all(isinstance(v, dict) for v in reply.values()) else [reply]


def _one(reply: dict) -> StoreConfig:
    values = _decoded(reply)
    aof = values.get("appendonly")  # absent where CONFIG answered only some names: unknown
    fsync = "unknown" if aof is None else values.get("appendfsync", "unknown") if aof == "yes" else "off"
    return StoreConfig(values.get("maxmemory-policy", "unknown"), fsync)


def weakest(configs: list[StoreConfig]) -> StoreConfig:
    """What every primary promises: the weakest fsync; an evicting policy where any primary has one."""
    if not configs:
        return StoreConfig()
    policy = next((c.policy for c in configs if c.evicting), configs[0].policy)
    fsync = min((c.fsync for c in configs), key=FSYNC_ORDER.index)
    return StoreConfig(policy, fsync)


async def read_config(redis: Any, cluster: bool) -> StoreConfig:
    """Every primary's configuration (``CONFIG GET``); unknown where CONFIG is refused; raises if Redis is down."""
    names = ("maxmemory-policy", "appendonly", "appendfsync")
    try:
        if cluster:
            reply = await redis.config_get(*names, target_nodes=RedisCluster.PRIMARIES)
            return weakest([_one(r) for r in _per_node(reply, cluster)])
        return _one(await redis.config_get(*names))
    except Exception as exc:  # noqa: BLE001 - an ACL or a renamed CONFIG (managed Redis): ask INFO instead
        if not _refused(exc):
            raise
    return await _from_info(redis, cluster)


def _refused(exc: Exception) -> bool:
    return "unknown command" in str(exc).lower() or "noperm" in str(exc).lower()


async def _from_info(redis: Any, cluster: bool) -> StoreConfig:
    """The policy as ``INFO memory`` tells it (fsync stays unknown: INFO does not say it)."""
    try:
        info = await (redis.info("memory", target_nodes=RedisCluster.PRIMARIES) if cluster else redis.info("memory"))
    except Exception as exc:  # noqa: BLE001 - INFO refused too: nothing known
        if _refused(exc):
            return StoreConfig()
        raise
    return weakest([StoreConfig(_decoded(n).get("maxmemory_policy", "unknown")) for n in _per_node(info, cluster)])
