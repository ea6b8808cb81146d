"""Session records in Redis: one record per session, from which any replica restores it.

One hash per session at ``{ns}:session:{id}``: ``version`` (a counter bumped by every save),
``data`` (JSON: mode, RocketKV config, messages, token ids, token digest, owner, turn stats, the
last turn's key and outcome, and ``kv``: what the cache's ``persist()`` wrote to Redis, or null)
and ``summary`` (a small JSON for listings); a sorted set ``{ns}:sessions`` indexes them by last
save time. The KV those records refer to are the tier's keys ``{ns}:session:{id}:kv:*``
(``tiers.redis_tier``); nothing else is kept per session. JSON only, never pickle. Keys expire
after an idle TTL that saves and loads renew.

Saves are compare-and-set on ``version``: a replica holding a stale copy (another replica took
the session over meanwhile) fails its save and so learns that its copy is stale. The store speaks
through the process's one ``RedisClient``, shared with the KV tier.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from tiers.redis_client import RedisClient

log = logging.getLogger(__name__)

# KEYS = session key, index key; ARGV = expected version ('' = must not exist), new version, data,
# summary, ttl, session id, now
_CAS_SAVE = """
local cur = redis.call('HGET', KEYS[1], 'version')
if (cur == false and ARGV[1] == '') or (cur ~= false and cur == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'version', ARGV[2], 'data', ARGV[3], 'summary', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('ZADD', KEYS[2], ARGV[7], ARGV[6])
  return 1
end
return 0
"""


class SessionStore:
    def __init__(self, client: RedisClient, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600, owns_client=False):
        self.client = client
        self.ns = namespace
        self.ttl_s = int(ttl_s)
        self._owns_client = owns_client  # closed with the store only where nothing else uses it
        self._redis = client.redis
        self._cas = self._redis.register_script(_CAS_SAVE)

    @classmethod
    def connect(cls, url: str, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600) -> "SessionStore":
        """A store with a connection of its own (a process without a KV tier: the Ray ingress)."""
        return cls(RedisClient(url), namespace, ttl_s, owns_client=True)

    def key(self, session_id: str) -> str:
        return f"{self.ns}:session:{session_id}"

    @property
    def _index(self) -> str:
        return f"{self.ns}:sessions"

    def _replica_key(self, replica: str) -> str:
        return f"{self.ns}:replica:{replica}"

    async def ping(self) -> bool:
        return bool(await self.client.call(self._redis.ping()))

    async def save(self, data: dict[str, Any], summary: dict[str, Any], expected_version: int | None) -> bool:
        """Write ``data`` as version ``expected_version + 1`` (or 1 for a new key); False if it moved on."""
        expected = "" if expected_version is None else str(expected_version)
        new_version = (expected_version or 0) + 1
        ok = await self.client.call(self._cas(
            keys=[self.key(data["id"]), self._index],
            args=[expected, str(new_version), json.dumps(data), json.dumps(summary), str(self.ttl_s),
                  data["id"], repr(time.time())],
        ))
        return bool(ok)

    async def load(self, session_id: str) -> tuple[dict[str, Any], int] | None:
        key = self.key(session_id)

        async def op():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hmget(key, "version", "data")
                pipe.expire(key, self.ttl_s)
                return await pipe.execute()

        (version, data), _ = await self.client.call(op())
        if version is None or data is None:
            return None
        return json.loads(data), int(version)

    async def version(self, session_id: str) -> int | None:
        value = await self.client.call(self._redis.hget(self.key(session_id), "version"))
        return None if value is None else int(value)

    async def delete(self, session_id: str) -> None:
        async def op():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.key(session_id))
                pipe.zrem(self._index, session_id)
                await pipe.execute()

        await self.client.call(op())

    async def summaries(self, limit: int = 1000, owner: str | None = None) -> list[dict[str, Any]]:
        """``owner``'s sessions among the ``limit`` most recently saved, newest first; index entries
        whose session expired are dropped on the way."""

        async def op():
            ids = await self._redis.zrevrange(self._index, 0, limit - 1)
            if not ids:
                return []
            async with self._redis.pipeline(transaction=False) as pipe:
                for sid in ids:
                    pipe.hget(self.key(sid.decode()), "summary")
                raws = await pipe.execute()
            gone = [sid for sid, raw in zip(ids, raws) if raw is None]
            if gone:
                await self._redis.zrem(self._index, *gone)
            return [raw for raw in raws if raw is not None]

        found = (json.loads(raw) for raw in await self.client.call(op()))
        return [s for s in found if s.get("owner") == owner]

    async def put_replica_stats(self, replica: str, stats: dict[str, Any], ttl_s: int) -> None:
        await self.client.call(self._redis.set(self._replica_key(replica), json.dumps(stats), ex=ttl_s))

    async def drop_replica_stats(self, replica: str) -> None:
        await self.client.call(self._redis.delete(self._replica_key(replica)))

    async def replica_stats(self) -> list[dict[str, Any]]:
        async def op():
            keys = [k async for k in self._redis.scan_iter(match=f"{self.ns}:replica:*", count=100)]
            return await self._redis.mget(keys) if keys else []

        return [json.loads(v) for v in await self.client.call(op()) if v]

    async def close(self) -> None:
        if self._owns_client:
            await asyncio.to_thread(self.client.close)
