"""Serving-side session records in Redis, so that any replica can restore a session whose replica is gone.

One hash per session at ``{ns}:session:{id}``: ``version`` (a counter bumped by every save),
``data`` (JSON: mode, RocketKV config, messages, token ids, token digest, owner, turn stats) and
``summary`` (a small JSON for listings); a sorted set ``{ns}:sessions`` indexes them by last
save time. JSON only, never pickle. Keys expire after an idle TTL that saves and loads renew.
(The engine keeps its own ``{ns}:session:{id}:meta`` and KV chunk keys next to these.)

Saves are compare-and-set on ``version``: a replica holding a stale copy (another replica took
the session over meanwhile) fails its save and so learns that its copy is stale.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis.asyncio as aioredis

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
    def __init__(self, url: str, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600, timeout_s: float = 2.0):
        self.url = url
        self.ns = namespace
        self.ttl_s = int(ttl_s)
        # Bounded waits: a hung Redis must slow a turn's save by seconds at most, never stall it.
        self._redis = aioredis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._cas = self._redis.register_script(_CAS_SAVE)

    def key(self, session_id: str) -> str:
        return f"{self.ns}:session:{session_id}"

    @property
    def _index(self) -> str:
        return f"{self.ns}:sessions"

    def _replica_key(self, replica: str) -> str:
        return f"{self.ns}:replica:{replica}"

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def save(self, data: dict[str, Any], summary: dict[str, Any], expected_version: int | None) -> bool:
        """Write ``data`` as version ``expected_version + 1`` (or 1 for a new key); False if it moved on."""
        expected = "" if expected_version is None else str(expected_version)
        new_version = (expected_version or 0) + 1
        ok = await self._cas(
            keys=[self.key(data["id"]), self._index],
            args=[expected, str(new_version), json.dumps(data), json.dumps(summary), str(self.ttl_s),
                  data["id"], repr(time.time())],
        )
        return bool(ok)

    async def load(self, session_id: str) -> tuple[dict[str, Any], int] | None:
        key = self.key(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hmget(key, "version", "data")
            pipe.expire(key, self.ttl_s)
            (version, data), _ = await pipe.execute()
        if version is None or data is None:
            return None
        return json.loads(data), int(version)

    async def exists_all(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` (full key names, in this namespace) exists."""
        if any(not k.startswith(f"{self.ns}:") for k in keys):
            raise ValueError("keys outside this store's namespace")
        return not keys or await self._redis.exists(*keys) == len(keys)

    async def version(self, session_id: str) -> int | None:
        value = await self._redis.hget(self.key(session_id), "version")
        return None if value is None else int(value)

    async def delete(self, session_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(session_id))
            pipe.zrem(self._index, session_id)
            await pipe.execute()

    async def summaries(self, limit: int = 1000, owner: str | None = None) -> list[dict[str, Any]]:
        """``owner``'s sessions among the ``limit`` most recently saved, newest first; index entries
        whose session expired are dropped on the way."""
        ids = await self._redis.zrevrange(self._index, 0, limit - 1)
        if not ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hget(self.key(sid), "summary")
            raws = await pipe.execute()
        gone = [sid for sid, raw in zip(ids, raws) if raw is None]
        if gone:
            await self._redis.zrem(self._index, *gone)
        found = (json.loads(raw) for raw in raws if raw is not None)
        return [s for s in found if s.get("owner") == owner]

    async def put_replica_stats(self, replica: str, stats: dict[str, Any], ttl_s: int) -> None:
        await self._redis.set(self._replica_key(replica), json.dumps(stats), ex=ttl_s)

    async def drop_replica_stats(self, replica: str) -> None:
        await self._redis.delete(self._replica_key(replica))

    async def replica_stats(self) -> list[dict[str, Any]]:
        keys = [k async for k in self._redis.scan_iter(match=f"{self.ns}:replica:*", count=100)]
        if not keys:
            return []
        return [json.loads(v) for v in await self._redis.mget(keys) if v]

    async def close(self) -> None:
        await self._redis.aclose()
