"""Session records in Redis: one record per session, from which any replica restores it.

One hash per session at ``{ns}:session:{<id>}`` (``tiers.store.redis.keys``: the braces put a session's
keys in one cluster slot): ``tag`` (a random fence each save draws), ``lineage`` (the tags of the last
saves, this one last), ``data`` (JSON: mode, RocketKV config, messages, token ids, token digest, owner,
turn stats, the last turn's key and outcome, and ``kv``: the KV generation the save wrote), ``summary``
(a small JSON for listings) and ``groups`` (the KV groups the record names, ``tiers.store.protocol``).
JSON only, never pickle. A record expires after an idle TTL that every save renews.

A save is one script, the commit point (``_COMMIT``): it writes only where the stored tag is the one the
saving copy last committed or loaded. A lost write cannot repeat a tag, so a store that went back (a
failover to a lagging replica, a crash with ``appendfsync everysec``) can never be taken for the copy's
own state: whatever stands there now, the save fails and says what it found, and ``app.session_fence``
judges it. The same script checks that every KV group the record names is there whole, makes those
groups live as long as the record, and deletes the groups the record named before and no longer does:
no sweeper, no manifest. A delete leaves a tombstone for one TTL (``deleted``) and deletes the KV its
record named in the same script; every later save of that session fails against it.

With ``min_replicas``, the save waits (``WAIT``, on the connection that wrote) for that many Redis
replicas; what the save can promise is reported (``Saved``): replicated, fsynced (``appendfsync
always``), or only in Redis's memory. Listings read a per-owner index (``{ns}:owner:{<owner>}``, a sorted
set by expiry, and the owner's stored bytes beside it) that forgets what expired; it is updated after the
commit, best effort. Replicas' totals live in one hash, ``{ns}:replicas``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from app.contract.events import Saved
from app.session_owners import OwnerIndex
from app.settings import Settings
from tiers.store.redis.client import RedisClient
from tiers.store.redis.config import StoreConfig
from tiers.store.redis.keys import kv_prefix, session_key
from tiers.store.redis.script import Script
from tiers.store.redis.url import is_sentinel

log = logging.getLogger(__name__)

# What a save finds: it committed; another tag is there; a tombstone; KV it names is gone.
SAVED, MOVED, DELETED, KV_MISSING = "saved", "moved", "deleted", "kv_missing"
LINEAGE = 64  # tags a record keeps: how far back a copy can tell "moved on from me" from "forked"

# KEYS = record, then the key of each group the record names. ARGV = expected tag ('' = must not exist),
# tag, lineage, data, summary, ttl, KV ttl, pending ttl, KV key prefix, '1' to leave the groups no longer
# named pending (else unlink them), then (group, items) of each group of KEYS[2..]. Returns {1} saved (or
# this very commit had landed: a lost reply, retried), {0, tag, lineage} another tag (or none) is there,
# {-1} a tombstone, {-2, group} a group it names is not there whole (nothing written then). The groups
# the record named before are read from it: same slot (one hash tag), so a cluster serves them here.
_COMMIT = """
local rec = KEYS[1]
if redis.call('HEXISTS', rec, 'deleted') == 1 then return {-1} end
local cur = redis.call('HGET', rec, 'tag')
if cur == false and redis.call('HEXISTS', rec, 'version') == 1 then cur = 'v' .. redis.call('HGET', rec, 'version') end
if cur == ARGV[2] then return {1} end
if not ((cur == false and ARGV[1] == '') or (cur ~= false and cur == ARGV[1])) then
  return {0, cur or '', redis.call('HGET', rec, 'lineage') or ''}
end
local named, names = {}, {}
for i = 2, #KEYS do
  local name, items = ARGV[9 + 2 * i - 2], tonumber(ARGV[10 + 2 * i - 2])
  if redis.call('HLEN', KEYS[i]) < items then return {-2, name} end
  named[name] = true
  names[#names + 1] = name
end
local old = redis.call('HGET', rec, 'groups') or ''
redis.call('HSET', rec, 'tag', ARGV[2], 'lineage', ARGV[3], 'data', ARGV[4], 'summary', ARGV[5],
           'groups', table.concat(names, ' '))
redis.call('EXPIRE', rec, ARGV[6])
for i = 2, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
for name in string.gmatch(old, '%S+') do
  if not named[name] then
    if ARGV[10] == '1' then redis.call('EXPIRE', ARGV[9] .. name, ARGV[8]) else redis.call('UNLINK', ARGV[9] .. name) end
  end
end
return {1}
"""

# KEYS = record; ARGV = tag, ttl, KV key prefix. The record becomes a tombstone, its KV unlinked.
_TOMBSTONE = """
local old = redis.call('HGET', KEYS[1], 'groups') or ''
for name in string.gmatch(old, '%S+') do redis.call('UNLINK', ARGV[3] .. name) end
redis.call('HDEL', KEYS[1], 'data', 'summary', 'groups', 'lineage')
redis.call('HSET', KEYS[1], 'tag', ARGV[1], 'deleted', 1)
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
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


def new_tag() -> str:
    return secrets.token_hex(8)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


@dataclass(frozen=True)
class Stored:
    """A session's record as it stands: its tag (None: there is none), its lineage, whether deleted."""

    tag: str | None
    lineage: tuple[str, ...] = ()
    deleted: bool = False

    @classmethod
    def of(cls, tag, lineage, deleted, version=None) -> "Stored":
        """From the record's fields; one written before records carried tags has its version stand in."""
        if tag is None and version is not None:
            tag = lineage = f"v{_text(version)}"
        if deleted is not None:
            return cls(_text(tag) or None, (), True)
        return cls(_text(tag) or None, tuple(_text(lineage).split()))


@dataclass(frozen=True)
class SaveResult:
    outcome: str
    stored: Stored | None = None  # what stood there instead (``MOVED``)
    saved: Saved | None = None  # what the save promises (``SAVED``)
    missing: str | None = None  # the group found short (``KV_MISSING``)


class SessionStore:
    def __init__(self, client: RedisClient, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600, owns_client=False,
                 pending_ttl_s: int = 600, min_replicas: int = 0, wait_timeout_s: float = 1.0,
                 config: Callable[[], StoreConfig] = StoreConfig):
        """``config``: what Redis promises now (``Engine.store_config``, read again after a failover)."""
        self.client = client
        self.ns = namespace
        self.ttl_s = int(ttl_s)
        self.kv_ttl_s = self.ttl_s + self.ttl_s // 4  # KV outlives the record naming it
        self.pending_ttl_s = int(pending_ttl_s)
        self.min_replicas, self.wait_ms = int(min_replicas), max(1, int(wait_timeout_s * 1000))
        self.config = config
        self.failover = client.cluster or is_sentinel(client.url)  # a replica may be promoted in the primary's place
        self._owns_client = owns_client  # closed with the store only where nothing else uses it
        self._redis = client.redis
        self._commit = Script(self._redis, _COMMIT)
        self._tombstone = Script(self._redis, _TOMBSTONE)
        self._put_replica = Script(self._redis, _PUT_REPLICA)
        self._live_replicas = Script(self._redis, _LIVE_REPLICAS)
        self.owners = OwnerIndex(client, namespace, self.ttl_s)

    @classmethod
    def configured(cls, client: RedisClient, settings: Settings, config: Callable[[], StoreConfig] = StoreConfig
                   ) -> "SessionStore":
        """The store a replica's settings ask for, on its engine's connection."""
        return cls(client, settings.redis_namespace, settings.redis_ttl_s, pending_ttl_s=settings.redis_pending_ttl_s,
                   min_replicas=settings.redis_min_replicas, wait_timeout_s=settings.redis_wait_timeout_s,
                   config=config)

    @classmethod
    def connect(cls, url: str, namespace: str = "rkv", ttl_s: int = 7 * 24 * 3600) -> "SessionStore":
        """A store with a connection of its own (a process without a KV tier: the Ray ingress)."""
        return cls(RedisClient(url), namespace, ttl_s, owns_client=True)

    def key(self, session_id: str) -> str:
        return session_key(self.ns, session_id)

    @property
    def _replicas(self) -> str:
        return f"{self.ns}:replicas"

    async def ping(self) -> bool:
        return bool(await self.client.call(self._redis.ping()))

    # --- saves -------------------------------------------------------------------------------
    async def save(self, data: dict[str, Any], summary: dict[str, Any], expected: str | None, tag: str,
                   lineage: list[str], groups: dict[str, int] | None, stored_bytes: int = 0) -> SaveResult:
        """Commit ``data`` under ``tag`` where the stored tag is ``expected`` (None: there must be no
        record), naming ``groups`` (None: the record names no KV, and the groups named before are left
        pending for their holder). Raises where Redis fails or refuses (full, under ``noeviction``)."""
        key, prefix = self.key(data["id"]), kv_prefix(self.ns, data["id"])
        pairs = [str(v) for g, n in (groups or {}).items() for v in (g, n)]
        args = [expected or "", tag, " ".join(lineage[-LINEAGE:]), json.dumps(data), json.dumps(summary),
                str(self.ttl_s), str(self.kv_ttl_s), str(self.pending_ttl_s), prefix, "1" if groups is None else "0",
                *pairs]
        keys = [key, *(prefix + g for g in groups or {})]
        reply, replicas = await self.client.call(self._written(_COMMIT, self._commit.sha, keys, args), key=key)
        code = int(reply[0])
        if code == 1:
            try:  # best effort: the record is committed, and a listing entry behind costs no session
                await self.owners.put(data.get("owner"), data["id"], self.ttl_s, stored_bytes)
            except Exception as exc:  # noqa: BLE001 - the owner's shard is out, or Redis is full
                log.warning("session %s saved but not listed (%s: %s)", data["id"], type(exc).__name__, exc)
            return SaveResult(SAVED, saved=self._saved(replicas))
        if code == 0:
            return SaveResult(MOVED, stored=Stored.of(reply[1] or None, reply[2], None))
        if code == -2:
            return SaveResult(KV_MISSING, missing=_text(reply[1]))
        return SaveResult(DELETED)

    async def _written(self, text: str, sha: str, keys: list[str], args: list[str]) -> tuple[Any, int]:
        """A script on ``keys`` (one slot) and, with ``min_replicas``, a ``WAIT`` on the same connection (one
        pipeline: ``WAIT`` counts the replicas that took this connection's writes); its reply and the
        replicas reached (0 where ``WAIT`` failed: the write stands, its replication is unknown)."""
        async def run(script: bool):
            async with self._redis.pipeline(transaction=False) as pipe:
                if script:
                    pipe.eval(text, len(keys), *keys, *args)
                else:
                    pipe.evalsha(sha, len(keys), *keys, *args)
                if self.min_replicas:
                    extra = {"target_nodes": self._redis.get_node_from_key(keys[0])} if self.client.cluster else {}
                    pipe.execute_command("WAIT", self.min_replicas, self.wait_ms, **extra)
                return await pipe.execute(raise_on_error=False)

        replies = await run(script=False)
        if isinstance(replies[0], NoScriptError):
            replies = await run(script=True)
        if isinstance(replies[0], BaseException):
            raise replies[0]
        waited = replies[1] if self.min_replicas else 0
        return replies[0], 0 if isinstance(waited, BaseException) else int(waited)

    def _saved(self, replicas: int) -> Saved:
        """What a committed save promises: replicated beats fsync beats memory. Where a failover may promote
        a replica (Sentinel, Cluster), a write on the primary's disk alone is not durable: the replica
        promoted may lack it."""
        config = self.config()
        if config.evicting:  # allowed knowingly (RKV_REDIS_ALLOW_EVICTION): Redis may drop it at any time
            return Saved(True, False, "memory", replicas)
        fsync = config.fsync_always
        if self.min_replicas and replicas >= self.min_replicas:
            return Saved(True, True, "replicated", replicas)
        return Saved(True, fsync and not self.failover, "fsync" if fsync else "memory", replicas)

    async def load(self, session_id: str) -> tuple[dict[str, Any], Stored] | None:
        key = self.key(session_id)
        tag, lineage, data, version = await self.client.call(
            self._redis.hmget(key, "tag", "lineage", "data", "version"), key=key)
        if data is None:  # absent, or a tombstone
            return None
        return json.loads(data), Stored.of(tag, lineage, None, version)

    async def stored(self, session_id: str) -> Stored:
        key = self.key(session_id)
        return Stored.of(*await self.client.call(self._redis.hmget(key, "tag", "lineage", "deleted", "version"),
                                                 key=key))

    async def stored_many(self, session_ids: list[str]) -> list[Stored | BaseException]:
        """``stored`` of many sessions, one pipelined request per shard (the error, for a session on a
        cluster shard that does not answer)."""
        if not session_ids:
            return []
        replies = await self.client.per_shard([self.key(sid) for sid in session_ids],
                                              lambda pipe, key: pipe.hmget(key, "tag", "lineage", "deleted", "version"))
        return [r if isinstance(r, BaseException) else Stored.of(*r) for r in replies]

    async def delete(self, session_id: str, owner: str | None) -> Saved:
        """Leave a tombstone in place of the record (for one TTL), deleting the KV it named, then drop it
        from its owner's listing (best effort: a listing drops a tombstone's entry anyway). What the
        tombstone's write promises, as a save's."""
        key = self.key(session_id)
        args = [new_tag(), str(self.ttl_s), kv_prefix(self.ns, session_id)]
        _, replicas = await self.client.call(self._written(_TOMBSTONE, self._tombstone.sha, [key], args), key=key)
        with contextlib.suppress(Exception):
            await self.owners.drop(owner, [session_id])
        return self._saved(replicas)

    # --- listings ----------------------------------------------------------------------------
    async def summaries(self, limit: int = 1000, owner: str | None = None) -> list[dict[str, Any]]:
        """``owner``'s ``limit`` most recently saved sessions, newest first. Entries whose record expired
        or is a tombstone are dropped on the way; those on a cluster shard that does not answer are left
        out of this listing (and kept)."""
        ids = await self.owners.ids(owner, limit)
        if not ids:
            return []
        replies = await self.client.per_shard([self.key(sid) for sid in ids],
                                              lambda pipe, key: pipe.hmget(key, "summary", "deleted"))
        gone = [sid for sid, reply in zip(ids, replies)
                if not isinstance(reply, BaseException) and (reply[0] is None or reply[1] is not None)]
        if gone:
            with contextlib.suppress(Exception):  # the next listing drops them
                await self.owners.drop(owner, gone)
        found = (json.loads(reply[0]) for reply in replies
                 if not isinstance(reply, BaseException) and reply[0] is not None and reply[1] is None)
        return [s for s in found if s.get("owner") == owner]

    # --- replicas ----------------------------------------------------------------------------
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
