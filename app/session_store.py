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
that session fails against it, so a save in flight cannot bring a deleted session back.

Every script and command touches one slot, so all of this works on a Redis Cluster: the
compare-and-set is on the record alone, and the index is updated after it, on its own. The index only
serves listings, which skip (and drop) entries whose record is gone or a tombstone, so an index update
lost or late (its shard down, a delete in between) costs a listing entry, never a session. Replicas'
totals live in one hash, ``{ns}:replicas``: a field per replica, stamped with Redis's own clock
(replicas' clocks may disagree) and ignored, then removed, once older than its TTL. The store
speaks through the process's one ``RedisClient``, shared with the KV tier.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from tiers.keys import session_key
from tiers.redis_client import RedisClient
from tiers.redis_script import Script

log = logging.getLogger(__name__)

# What a save finds: it wrote its version; another version is there; or a tombstone is.
SAVED, MOVED, DELETED = "saved", "moved", "deleted"
# ``version`` of a deleted session (its tombstone).
TOMBSTONE = -1

# KEYS = session key; ARGV = expected version ('' = must not exist), new version, data, summary, ttl.
# Returns 1 (saved), 0 (another version) or -1 (a tombstone).
_CAS_SAVE = """
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then
  return -1
end
local cur = redis.call('HGET', KEYS[1], 'version')
if (cur == false and ARGV[1] == '') or (cur ~= false and cur == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'version', ARGV[2], 'data', ARGV[3], 'summary', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
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

# KEYS = replicas hash; ARGV = replica, stats JSON, ttl. The field holds "<expiry, Redis's clock> <JSON>";
# the hash itself lives as long as its newest field, so it goes once every replica is gone.
_PUT_REPLICA = """
local expires = tonumber(redis.call('TIME')[1]) + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], expires .. ' ' .. ARGV[2])
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
"""

# KEYS = replicas hash. The live fields' JSON; the expired ones are removed.
_LIVE_REPLICAS = """
local now = tonumber(redis.call('TIME')[1])
local fields = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #fields, 2 do
  local value = fields[i + 1]
  local space = string.find(value, ' ', 1, true)
  if space and tonumber(string.sub(value, 1, space - 1)) >= now then
    live[#live + 1] = string.sub(value, space + 1)
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
return live
"""


class SessionStore:
    def __init__(self, client: RedisClient, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600, owns_client=False):
        self.client = client
        self.ns = namespace
        self.ttl_s = int(ttl_s)
        self._owns_client = owns_client  # closed with the store only where nothing else uses it
        self._redis = client.redis
        self._cas = Script(self._redis, _CAS_SAVE)
        self._tombstone = Script(self._redis, _TOMBSTONE)
        self._put_replica = Script(self._redis, _PUT_REPLICA)
        self._live_replicas = Script(self._redis, _LIVE_REPLICAS)

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

    @property
    def _replicas(self) -> str:
        return f"{self.ns}:replicas"

    async def ping(self) -> bool:
        return bool(await self.client.call(self._redis.ping()))

    async def save(self, data: dict[str, Any], summary: dict[str, Any], expected_version: int | None) -> str:
        """Write ``data`` as version ``expected_version + 1`` (or 1 for a new key): ``SAVED``; ``MOVED``
        when another version is there, ``DELETED`` when the session was deleted."""
        expected = "" if expected_version is None else str(expected_version)
        new_version = (expected_version or 0) + 1
        key = self.key(data["id"])
        ok = await self.client.call(self._cas(
            [key], [expected, str(new_version), json.dumps(data), json.dumps(summary), str(self.ttl_s)]
        ), key=key)
        outcome = {1: SAVED, 0: MOVED}.get(int(ok), DELETED)
        if outcome == SAVED:
            await self._indexed(data["id"])
        return outcome

    async def _indexed(self, session_id: str) -> None:
        """List a saved session. Best effort: the record is committed already, and a save that raised now
        would be taken for one that failed (its KV generation removed)."""
        try:
            await self.client.call(self._redis.zadd(self._index, {session_id: time.time()}), key=self._index)
        except Exception as exc:  # noqa: BLE001 - the index's shard is out: the next save lists it
            log.warning("session %s saved but not listed (%s: %s)", session_id, type(exc).__name__, exc)

    async def load(self, session_id: str) -> tuple[dict[str, Any], int] | None:
        key = self.key(session_id)

        version, data = await self.client.call(self._redis.hmget(key, "version", "data"), key=key)
        if version is None or data is None:  # absent, or a tombstone
            return None
        return json.loads(data), int(version)

    async def version(self, session_id: str) -> int | None:
        """The stored version; None when there is no record, ``TOMBSTONE`` when the session was deleted."""
        key = self.key(session_id)
        value, deleted = await self.client.call(self._redis.hmget(key, "version", "deleted"), key=key)
        if deleted is not None:
            return TOMBSTONE
        return None if value is None else int(value)

    async def delete(self, session_id: str) -> None:
        """Leave a tombstone in place of the record (for one TTL), drop it from the listing (best effort:
        a listing drops a tombstone's entry anyway), and log it as deleting until its KV keys are gone
        (``deleted``), so that any replica finishes a delete whose replica died half way."""
        key = self.key(session_id)
        await self.client.call(self._tombstone([key], [str(self.ttl_s)]), key=key)
        with contextlib.suppress(Exception):
            await self.client.call(self._redis.zrem(self._index, session_id), key=self._index)
        await self.client.call(self._redis.zadd(self._deleting, {session_id: time.time()}), key=self._deleting)

    async def deleted(self, session_id: str) -> None:
        """A delete's KV keys are gone: it leaves the log."""
        await self.client.call(self._redis.zrem(self._deleting, session_id), key=self._deleting)

    async def unfinished_deletes(self, older_than_s: float, limit: int = 16) -> list[str]:
        """Deletes logged more than ``older_than_s`` ago whose KV keys may remain."""
        ids = await self.client.call(self._redis.zrangebyscore(
            self._deleting, "-inf", time.time() - older_than_s, start=0, num=limit), key=self._deleting)
        return [i.decode() for i in ids]

    async def versions(self, session_ids: list[str]) -> list[int | None | BaseException]:
        """``version`` of many sessions, one pipelined request per shard (None: no record; ``TOMBSTONE``;
        the error, for a session on a cluster shard that does not answer)."""
        if not session_ids:
            return []
        replies = await self.client.per_shard([self.key(sid) for sid in session_ids],
                                              lambda pipe, key: pipe.hmget(key, "version", "deleted"))
        return [reply if isinstance(reply, BaseException) else TOMBSTONE if reply[1] is not None
                else None if reply[0] is None else int(reply[0]) for reply in replies]

    async def summaries(self, limit: int = 1000, owner: str | None = None) -> list[dict[str, Any]]:
        """``owner``'s sessions among the ``limit`` most recently saved, newest first. Index entries whose
        record expired or is a tombstone are dropped on the way; those on a cluster shard that does not
        answer are left out of this listing (and kept)."""
        ids = [sid.decode() for sid in await self.client.call(
            self._redis.zrevrange(self._index, 0, limit - 1), key=self._index)]
        if not ids:
            return []
        replies = await self.client.per_shard([self.key(sid) for sid in ids],
                                              lambda pipe, key: pipe.hmget(key, "summary", "deleted"))
        gone = [sid for sid, reply in zip(ids, replies)
                if not isinstance(reply, BaseException) and (reply[0] is None or reply[1] is not None)]
        if gone:
            with contextlib.suppress(Exception):  # the next listing drops them
                await self.client.call(self._redis.zrem(self._index, *gone), key=self._index)
        found = (json.loads(reply[0]) for reply in replies
                 if not isinstance(reply, BaseException) and reply[0] is not None and reply[1] is None)
        return [s for s in found if s.get("owner") == owner]

    async def put_replica_stats(self, replica: str, stats: dict[str, Any], ttl_s: int) -> None:
        await self.client.call(self._put_replica([self._replicas], [replica, json.dumps(stats), str(int(ttl_s))]),
                               key=self._replicas)

    async def drop_replica_stats(self, replica: str) -> None:
        await self.client.call(self._redis.hdel(self._replicas, replica), key=self._replicas)

    async def replica_stats(self) -> list[dict[str, Any]]:
        """Every live replica's latest totals (one hash, one slot: one call on a cluster too)."""
        return [json.loads(v) for v in await self.client.call(self._live_replicas([self._replicas], []),
                                                              key=self._replicas)]

    async def close(self) -> None:
        if self._owns_client:
            await asyncio.to_thread(self.client.close)
