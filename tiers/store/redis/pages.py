"""The page store (``tiers.store.protocol``) on Redis, a Redis Cluster or Redis Sentinel: a session's
items as fields of one hash per group (``tiers.store.redis.keys``), values packed by ``tiers.store.wire``.
A group's hash is created pending (``EXPIRE … NX``), and renewed with ``GT``: neither ever shortens the
life a record's commit gave it. Every call touches one session's keys, in one slot: a pipeline goes to
one shard in one round trip, through its circuit.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any

from tiers.base import PageBatch, TierStats
from tiers.store.protocol import group_of
from tiers.store.redis.client import RedisClient, RedisUnavailable
from tiers.store.redis.keys import kv_key
from tiers.store.wire import pack, unpack

log = logging.getLogger(__name__)


# KEYS = a group's hash; ARGV = its pending TTL, then field, value pairs. The hash and its TTL in one
# step: one cut off between an HSET and its EXPIRE would live for ever (a renewal's GT never shortens).
_PUT = "redis.call('HSET', KEYS[1], unpack(ARGV, 2)) redis.call('EXPIRE', KEYS[1], ARGV[1], 'NX') return 1"
PUT_FIELDS = 256  # items one _PUT writes (Lua's unpack has a bound)
PUT_BYTES = 32 << 20  # bytes one round trip of a put carries at most


def _by_group(names: list[str]) -> dict[str, list[str]]:
    """Items' fields by group, in the order first met."""
    out: dict[str, list[str]] = {}
    for name in names:
        group, _, field = name.partition("/")
        out.setdefault(group, []).append(field)
    return out


class RedisPageStore:
    def __init__(self, client: RedisClient, namespace: str = "rkv", pending_ttl_s: int = 600):
        self.client = client
        self.ns, self.pending_ttl_s = namespace, int(pending_ttl_s)
        self.stats = TierStats()
        self._sizes: dict[str, dict[str, int]] = {}  # per session: bytes of each item it wrote
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()  # the counters' owner: held for bookkeeping only, never across a call
        self._redis = client.redis
        self._full_until = 0.0  # Redis refused a write for want of memory: writes count as unavailable till then

    last_error = property(lambda self: self.client.last_error)

    def unavailable(self, session_id: str | None = None) -> bool:
        """Unreachable (its circuit open), or full: a Redis at ``maxmemory`` under ``noeviction`` refuses
        writes, so the host tier holds room for a turn's demotions (or refuses it) instead of spilling."""
        full = time.monotonic() < self._full_until
        return full or self.client.unavailable(None if session_id is None else self._key(session_id, ""))

    def _key(self, session_id: str, group: str) -> str:
        return kv_key(self.ns, session_id, group)

    def _run(self, session_id: str, coro: Coroutine[Any, Any, Any], default=None):
        """Run through the circuit of the session's shard and wait; on failure, count it: ``default``."""
        try:
            return self.client.run(coro, key=self._key(session_id, ""))
        except RedisUnavailable:  # refused at once: the failure that opened the circuit was logged
            self._count_error()
        except Exception as exc:  # noqa: BLE001 - any Redis failure degrades the tier, never the turn
            self._count_error()
            if "OOM" in str(exc):  # full: looked at again after the circuit's first back-off
                self._full_until = time.monotonic() + self.client.breaker.first_s
            log.warning("page store error: %s", self.client.last_error)
        return default

    def _count_error(self) -> None:
        with self._lock:
            self.stats.errors += 1

    def _pipeline(self, session_id: str, queue, default=None):
        """One round trip: ``queue(pipe)`` adds the commands; their replies, or ``default``."""
        async def op():
            async with self._redis.pipeline(transaction=False) as pipe:
                queue(pipe)
                return await pipe.execute()

        return self._run(session_id, op(), default)

    # --- items -------------------------------------------------------------------------------
    def put(self, session_id: str, items: dict[str, PageBatch]) -> bool:
        """In round trips of at most ``PUT_BYTES`` (a first turn's whole history at once could outlast the
        client's timeout): each ``_PUT`` writes some items of one group and its TTL in one step."""
        if not items:
            return True
        packed = {name: pack(tensors) for name, tensors in items.items()}
        calls: list[list] = [[]]
        size = 0
        for name, value in packed.items():
            group, _, field = name.partition("/")
            if size + len(value) > PUT_BYTES and calls[-1]:
                calls.append([])
                size = 0
            call = calls[-1][-1] if calls[-1] else None
            if call is None or call[0] != group or len(call) > 2 * PUT_FIELDS:
                calls[-1].append(call := [group])
            call += [field, value]
            size += len(value)
        for batch in calls:
            queued = [(self._key(session_id, c[0]), c[1:]) for c in batch]
            if self._pipeline(session_id, lambda pipe, q=queued: [pipe.eval(_PUT, 1, key, self.pending_ttl_s, *pairs)
                                                                  for key, pairs in q]) is None:
                return False
        self._account_write(session_id, {name: len(value) for name, value in packed.items()})
        return True

    def get(self, session_id: str, names: list[str]) -> list[PageBatch | None]:
        if not names:
            return []
        groups = _by_group(names)
        replies = self._pipeline(session_id, lambda pipe: [pipe.hmget(self._key(session_id, g), fields)
                                                           for g, fields in groups.items()])
        found: dict[str, bytes | None] = {}
        for (group, fields), values in zip(groups.items(), replies or [[None] * len(f) for f in groups.values()]):
            found.update((f"{group}/{field}", value) for field, value in zip(fields, values))
        out = [None if found[name] is None else self._unpacked(found[name]) for name in names]
        sizes = [len(found[name]) for name in names if found[name] is not None]
        with self._lock:
            self.stats.misses += len(names) - len(sizes)
            self.stats.hits += len(sizes)
            self.stats.promotions += len(sizes)
            self.stats.bytes_read += sum(sizes)
        return out

    def _unpacked(self, value: bytes) -> PageBatch | None:
        """A stored value's tensors; None (as if missing: nothing wrong is served) where it does not parse."""
        try:
            return unpack(value)
        except (ValueError, KeyError, RuntimeError):
            self._count_error()
            return None

    def has(self, session_id: str, names: list[str]) -> list[bool] | None:
        if not names:
            return []
        replies = self._pipeline(session_id, lambda pipe: [pipe.hexists(self._key(session_id, group_of(n)),
                                                                        n.partition("/")[2]) for n in names])
        return None if replies is None else [bool(r) for r in replies]

    def sizes(self, session_id: str, groups: list[str]) -> list[int] | None:
        if not groups:
            return []
        replies = self._pipeline(session_id, lambda pipe: [pipe.hlen(self._key(session_id, g)) for g in groups])
        return None if replies is None else [int(r) for r in replies]

    def renew(self, session_id: str, groups: list[str]) -> bool:
        if not groups:
            return True
        return self._pipeline(session_id, lambda pipe: [pipe.expire(self._key(session_id, g), self.pending_ttl_s,
                                                                    gt=True) for g in groups]) is not None

    def delete(self, session_id: str, names: list[str]) -> bool:
        if not names:
            return True
        whole = [n for n in names if "/" not in n]
        fields = _by_group([n for n in names if "/" in n])

        def queue(pipe):
            if whole:
                pipe.delete(*(self._key(session_id, g) for g in whole))
            for group, items in fields.items():
                pipe.hdel(self._key(session_id, group), *items)

        if self._pipeline(session_id, queue) is None:
            return False
        self._account_delete(session_id, names)
        return True

    # --- accounting --------------------------------------------------------------------------
    def _account_write(self, session_id: str, written: dict[str, int]) -> None:
        with self._lock:
            sizes = self._sizes.setdefault(session_id, {})
            for name, nbytes in written.items():
                old = sizes.get(name)
                if old is None:
                    self.stats.entries += 1
                    self.stats.demotions += 1
                delta = nbytes - (old or 0)
                self.stats.bytes += delta
                self._bytes[session_id] = self._bytes.get(session_id, 0) + delta
                self.stats.bytes_written += nbytes
                sizes[name] = nbytes

    def _account_delete(self, session_id: str, names: list[str] | None = None) -> None:
        """Stop counting these items (a bare group name: all its items) of a session (None: all, and the session)."""
        with self._lock:
            sizes = self._sizes.get(session_id, {})
            if names is None:
                gone = list(sizes)
            else:
                named = set(names)
                whole = {n for n in named if "/" not in n}
                gone = [n for n in sizes if n in named or group_of(n) in whole]
            freed = sum(sizes.pop(n) for n in gone)
            self.stats.bytes -= freed
            self.stats.entries -= len(gone)
            if names is None or not sizes:
                self._sizes.pop(session_id, None)
                self._bytes.pop(session_id, None)
            else:
                self._bytes[session_id] -= freed

    def session_bytes(self, session_id: str) -> int:
        return self._bytes.get(session_id, 0)

    def forget(self, session_id: str) -> None:
        self._account_delete(session_id)

    def close(self) -> None:
        """Close the connection; the session records share it, so this comes last."""
        self.client.close()
