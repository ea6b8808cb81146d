"""Each owner's sessions in Redis (an owner is a digest of an API key; ``None``, every caller of a server
without keys): what listings read and what quotas count.

Two keys in the owner's own slot (``tiers.store.redis.keys.owner_key``): a sorted set of its session ids
by the time their record expires, and a hash of their stored bytes with the total beside them
(``~total``). A save puts its session there after its record committed; a delete or a listing that finds
a record gone takes it out; every read first forgets the entries past their expiry, so the index never
lists, nor counts, what Redis already let go. Each change is one script, so the total always matches the
entries. Best effort after the commit: an index behind by a save costs a listing entry, never a session.
"""
from __future__ import annotations

import time

from tiers.store.redis.client import RedisClient
from tiers.store.redis.keys import owner_key
from tiers.store.redis.script import Script

TOTAL = "~total"

# KEYS = index, bytes; ARGV = ttl, then (session, seconds it lives, bytes) triples ('' = remove it).
# Times are Redis's own (TIME): replicas' clocks may differ, the store's is the one that expires records.
# Entries past now go first; the keys live as long as their newest entry.
_UPDATE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local function drop(sid)
  local had = tonumber(redis.call('HGET', KEYS[2], sid) or '0')
  redis.call('HDEL', KEYS[2], sid)
  redis.call('HINCRBY', KEYS[2], '~total', -had)
  redis.call('ZREM', KEYS[1], sid)
end
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do drop(sid) end
for i = 2, #ARGV, 3 do
  if ARGV[i + 1] == '' then
    drop(ARGV[i])
  else
    local had = tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0')
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 2])
    redis.call('HINCRBY', KEYS[2], '~total', tonumber(ARGV[i + 2]) - had)
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[i + 1]), ARGV[i])
  end
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('HGET', KEYS[2], '~total') or '0')}
"""


class OwnerIndex:
    def __init__(self, client: RedisClient, namespace: str, ttl_s: int):
        self.client, self.ns, self.ttl_s = client, namespace, int(ttl_s)
        self._update = Script(client.redis, _UPDATE)
        self._seen: dict[str | None, tuple[float, tuple[int, int]]] = {}  # owner -> (when, usage) as last read

    def _keys(self, owner: str | None) -> list[str]:
        index = owner_key(self.ns, owner)
        return [index, f"{index}:bytes"]

    async def _run(self, owner: str | None, triples: list[str]) -> tuple[int, int]:
        keys = self._keys(owner)
        sessions, nbytes = await self.client.call(
            self._update(keys, [str(self.ttl_s), *triples]), key=keys[0])
        self._seen[owner] = (time.monotonic(), (int(sessions), int(nbytes)))
        return int(sessions), int(nbytes)

    async def put(self, owner: str | None, session_id: str, lives_s: float, nbytes: int) -> None:
        """Index the session as living ``lives_s`` more seconds (its record's TTL), holding ``nbytes``."""
        await self._run(owner, [session_id, repr(float(lives_s)), str(int(nbytes))])

    async def drop(self, owner: str | None, session_ids: list[str]) -> None:
        await self._run(owner, [v for sid in session_ids for v in (sid, "", "0")])

    async def usage(self, owner: str | None, max_age_s: float = 0.0) -> tuple[int, int]:
        """(sessions, stored bytes) the owner keeps in Redis: as last read or updated here (every save of the
        owner's sessions updates it) if that is at most ``max_age_s`` old, else read now."""
        seen = self._seen.get(owner)
        if seen is not None and time.monotonic() - seen[0] <= max_age_s:
            return seen[1]
        return await self._run(owner, [])

    async def ids(self, owner: str | None, limit: int) -> list[str]:
        """The owner's ``limit`` most recently saved sessions, newest first."""
        await self._run(owner, [])  # expired entries go first
        index = self._keys(owner)[0]
        return [sid.decode() for sid in await self.client.call(self.client.redis.zrevrange(index, 0, limit - 1),
                                                               key=index)]
