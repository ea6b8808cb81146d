"""Session records in Redis: one record per session, from which any replica restores it.

One hash per session at ``{ns}:session:{<id>}`` (``tiers.keys``: the braces put a session's keys in one
cluster slot): ``version`` (a counter bumped by every save), ``data`` (JSON: mode, RocketKV config,
messages, token ids, token digest, owner, turn stats, the last turn's key and outcome, and ``kv``: the
KV generation the cache's ``persist()`` wrote, ``tiers.session_kv``, or null) and ``summary`` (a small
JSON for listings); a sorted set ``{ns}:sessions`` indexes them by last save time. JSON only, never
pickle. A record expires after an idle TTL that every save renews (a load does not: a session nobody
takes a turn in is idle, and its KV, renewed only by saves, must not expire before it).

Saves are compare-and-set on ``version``: a replica holding a stale copy (another replica took the
session over meanwhile) fails its save and so learns that its copy is stale. A delete leaves a
tombstone for one TTL (``deleted``, the version bumped, data and summary gone): every later save of
that session fails against it, so a save in flight cannot bring a deleted session back. The store
speaks through the process's one ``RedisClient``, shared with the KV tier.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from tiers.keys import session_key
from tiers.redis_client import RedisClient

log = logging.getLogger(__name__)

# What a save finds: it wrote its version; another version is there; or a tombstone is.
SAVED, MOVED, DELETED = "saved", "moved", "deleted"
# ``version`` of a deleted session (its tombstone).
TOMBSTONE = -1

# KEYS = session key, index key; ARGV = expected version ('' = must not exist), new version, data,
# summary, ttl, session id, now. Returns 1 (saved), 0 (another version) or -1 (a tombstone).
_CAS_SAVE = """
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then
  return -1
end
local cur = redis.call('HGET', KEYS[1], 'version')
if (cur == false and ARGV[1] == '') or (cur ~= false and cur == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'version', ARGV[2], 'data', ARGV[3], 'summary', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('ZADD', KEYS[2], ARGV[7], ARGV[6])
  return 1
end
return 0
"""

# KEYS = session key; ARGV = ttl. The record becomes a tombstone: a bumped version, no data or summary.
_TOMBSTONE = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
redis.call('HDEL', KEYS[1], 'data', 'summary')
redis.call('HSET', KEYS[1], 'version', cur + 1, 'deleted', 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return cur + 1
"""


class SessionStore:
    def __init__(self, client: RedisClient, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600, owns_client=False):
        self.client = client
        self.ns = namespace
        self.ttl_s = int(ttl_s)
        self._owns_client = owns_client  # closed with the store only where nothing else uses it
        self._redis = client.redis
        self._cas = self._redis.register_script(_CAS_SAVE)
        self._tombstone = self._redis.register_script(_TOMBSTONE)

    @classmethod
    def connect(cls, url: str, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600) -> "SessionStore":
        """A store with a connection of its own (a process without a KV tier: the Ray ingress)."""
        return cls(RedisClient(url), namespace, ttl_s, owns_client=True)

    def key(self, session_id: str) -> str:
        return session_key(self.ns, session_id)

    @property
    def _index(self) -> str:
        return f"{self.ns}:sessions"

    @property
    def _deleting(self) -> str:
        """Sessions deleted whose KV keys may remain (a replica died mid-delete): id -> time of the delete."""
        return f"{self.ns}:deleting"

    def _replica_key(self, replica: str) -> str:
        return f"{self.ns}:replica:{replica}"

    async def ping(self) -> bool:
        return bool(await self.client.call(self._redis.ping()))

    async def save(self, data: dict[str, Any], summary: dict[str, Any], expected_version: int | None) -> str:
        """Write ``data`` as version ``expected_version + 1`` (or 1 for a new key): ``SAVED``; ``MOVED``
        when another version is there, ``DELETED`` when the session was deleted."""
        expected = "" if expected_version is None else str(expected_version)
        new_version = (expected_version or 0) + 1
        ok = await self.client.call(self._cas(
            keys=[self.key(data["id"]), self._index],
            args=[expected, str(new_version), json.dumps(data), json.dumps(summary), str(self.ttl_s),
                  data["id"], repr(time.time())],
        ))
        return {1: SAVED, 0: MOVED}.get(int(ok), DELETED)

    async def load(self, session_id: str) -> tuple[dict[str, Any], int] | None:
        key = self.key(session_id)

        version, data = await self.client.call(self._redis.hmget(key, "version", "data"))
        if version is None or data is None:  # absent, or a tombstone
            return None
        return json.loads(data), int(version)

    async def version(self, session_id: str) -> int | None:
        """The stored version; None when there is no record, ``TOMBSTONE`` when the session was deleted."""
        value, deleted = await self.client.call(self._redis.hmget(self.key(session_id), "version", "deleted"))
        if deleted is not None:
            return TOMBSTONE
        return None if value is None else int(value)

    async def delete(self, session_id: str) -> None:
        """Leave a tombstone in place of the record (for one TTL), drop it from the listing, and log it
        as deleting until its KV keys are gone (``deleted``), so that any replica finishes a delete
        whose replica died half way."""
        await self.client.call(self._tombstone(keys=[self.key(session_id)], args=[str(self.ttl_s)]))
        await self.client.call(self._redis.zrem(self._index, session_id))
        await self.client.call(self._redis.zadd(self._deleting, {session_id: time.time()}))

    async def deleted(self, session_id: str) -> None:
        """A delete's KV keys are gone: it leaves the log."""
        await self.client.call(self._redis.zrem(self._deleting, session_id))

    async def unfinished_deletes(self, older_than_s: float, limit: int = 16) -> list[str]:
        """Deletes logged more than ``older_than_s`` ago whose KV keys may remain."""
        ids = await self.client.call(self._redis.zrangebyscore(
            self._deleting, "-inf", time.time() - older_than_s, start=0, num=limit))
        return [i.decode() for i in ids]

    async def versions(self, session_ids: list[str]) -> list[int | None]:
        """``version`` of many sessions in one pipelined request (None: no record; ``TOMBSTONE``)."""
        if not session_ids:
            return []

        async def op():
            async with self._redis.pipeline(transaction=False) as pipe:
                for sid in session_ids:
                    pipe.hmget(self.key(sid), "version", "deleted")
                return await pipe.execute()

        replies = await self.client.call(op())
        return [TOMBSTONE if deleted is not None else None if version is None else int(version)
                for version, deleted in replies]

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
