"""Session metadata in Redis, so that any replica can restore a session whose replica is gone.

One hash per session at ``{prefix}:session:{id}``: ``version`` (a counter bumped by every save),
``data`` (JSON: mode, RocketKV config, messages, token ids, owner-token digest, timestamps) and
``summary`` (a small JSON for listings). JSON only, never pickle. Keys expire after an idle TTL
that every save and restore renews.

Saves are compare-and-set on ``version``: a replica that holds a stale copy (another replica
took the session over meanwhile) fails its save and learns that its copy is stale.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

# KEYS[1] = session key; ARGV = expected version ('' = must not exist), new version, data, summary, ttl
_CAS_SAVE = """
local cur = redis.call('HGET', KEYS[1], 'version')
if (cur == false and ARGV[1] == '') or (cur ~= false and cur == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'version', ARGV[2], 'data', ARGV[3], 'summary', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  return 1
end
return 0
"""


class SessionStore:
    def __init__(self, url: str, prefix: str = "rkv", ttl_s: int = 7 * 24 * 3600):
        self.url = url
        self.prefix = prefix
        self.ttl_s = int(ttl_s)
        self._redis = aioredis.from_url(url, decode_responses=True)
        self._cas = self._redis.register_script(_CAS_SAVE)

    def key(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    def _replica_key(self, replica: str) -> str:
        return f"{self.prefix}:replica:{replica}"

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def save(self, data: dict[str, Any], summary: dict[str, Any], expected_version: int | None) -> bool:
        """Write ``data`` as version ``expected_version + 1`` (or 1 for a new key); False if it moved on."""
        expected = "" if expected_version is None else str(expected_version)
        new_version = (expected_version or 0) + 1
        ok = await self._cas(
            keys=[self.key(data["id"])],
            args=[expected, str(new_version), json.dumps(data), json.dumps(summary), str(self.ttl_s)],
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

    async def version(self, session_id: str) -> int | None:
        value = await self._redis.hget(self.key(session_id), "version")
        return None if value is None else int(value)

    async def delete(self, session_id: str) -> None:
        await self._redis.delete(self.key(session_id))

    async def summaries(self, limit: int = 1000) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        async for key in self._redis.scan_iter(match=f"{self.prefix}:session:*", count=200):
            raw = await self._redis.hget(key, "summary")
            if raw:
                out.append(json.loads(raw))
            if len(out) >= limit:
                break
        return out

    async def put_replica_stats(self, replica: str, stats: dict[str, Any], ttl_s: int) -> None:
        await self._redis.set(self._replica_key(replica), json.dumps(stats), ex=ttl_s)

    async def drop_replica_stats(self, replica: str) -> None:
        await self._redis.delete(self._replica_key(replica))

    async def replica_stats(self) -> list[dict[str, Any]]:
        keys = [k async for k in self._redis.scan_iter(match=f"{self.prefix}:replica:*", count=100)]
        if not keys:
            return []
        return [json.loads(v) for v in await self._redis.mget(keys) if v]

    async def close(self) -> None:
        await self._redis.aclose()
