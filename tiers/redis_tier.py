"""Redis tier: raw tensor bytes plus a JSON header per key (never pickle), namespaced, with a TTL.

A session's KV keys are named by ``tiers.keys`` (one hash tag per session) beside its record, and every
name written is first added to the session's manifest with this process's writer id, so its keys are
found and removed without a scan of the keyspace. A writer logs each session it writes for
(``writing_key``) until the session leaves it and keeps a liveness key while it lives (``keep_alive``):
what a writer that died left unnamed (a replica killed mid-turn) is found and swept by another
(``dead_writings``, ``sweep_writer``; ``tiers.session_kv`` says what the record names). The keys
outlive the record that names them by a quarter of its TTL (``kv_ttl_s``): the record is renewed at every save, the KV at saves a quarter TTL apart
(``tiers.session_kv``), so KV never expires before the record naming it does.

The tier speaks through the process's one ``RedisClient``, blocking its caller (the model thread, the
page reader, the host tier's spills) for each call, with a timeout and behind the circuit breaker of
the session's shard (on a Redis Cluster; the client's on one Redis). Every call touches one session's
keys, in one slot: its pipelines (``transaction=False``, the form a cluster pipeline takes) go to one
shard in one round trip. Failures are counted and reported (``healthy``/``last_error``); they are never raised into a
chat turn.

What this process wrote is counted per session (bytes and keys, for ``session_bytes`` and the tier's
totals) under the tier's own lock, which no call to Redis is made under; a session's counts go when
it is deleted or leaves this process (``forget_session``).
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Coroutine
from typing import Any

import torch

from tiers.base import PageBatch, TierStats
from tiers.keys import kv_key, manifest_key, writer_key, writing_key
from tiers.redis_client import RedisClient, RedisUnavailable
from tiers.redis_script import Script

log = logging.getLogger(__name__)
WRITER_TTL_S = 30  # a writer not heard of for this long is dead: what it left unnamed is swept
# KEYS[1]: a manifest; ARGV: the dead writer, the session's KV key prefix, then the names its record names.
# Deletes the keys that writer wrote last and the record does not name; returns how many.
SWEEP = """
local named = {}
for i = 3, #ARGV do named[ARGV[i]] = true end
local owners = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #owners, 2 do
  local name = owners[i]
  if owners[i + 1] == ARGV[1] and not named[name] then
    redis.call('DEL', ARGV[2] .. name)
    redis.call('HDEL', KEYS[1], name)
    n = n + 1
  end
end
return n
"""
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.int32, torch.uint8, torch.int8)
}


def encode_tensors(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> tuple[bytes, bytes]:
    """(JSON header, raw bytes): header lists each tensor's dtype, shape and byte offset."""
    header, blobs, offset = {"tensors": {}, "meta": meta or {}}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header["tensors"][name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset, "nbytes": len(raw)}
        blobs.append(raw)
        offset += len(raw)
    return json.dumps(header).encode(), b"".join(blobs)


def decode_tensors(header: bytes, data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of ``encode_tensors``; rejects unknown dtypes and inconsistent sizes."""
    head = json.loads(header)
    out = {}
    for name, spec in head["tensors"].items():
        dtype = _DTYPES.get(spec["dtype"])
        if dtype is None:
            raise ValueError(f"unsupported dtype {spec['dtype']!r} in tensor header")
        start, n = int(spec["offset"]), int(spec["nbytes"])
        raw = bytearray(data[start : start + n])
        if len(raw) != n:
            raise ValueError("tensor data shorter than its header says")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(spec["shape"]).clone()
    return out, head.get("meta", {})


class RedisTier:
    def __init__(self, client: RedisClient, namespace: str = "rkv", ttl_s: int = 86400):
        self.client = client
        self.ns, self.ttl_s = namespace, ttl_s  # the records' TTL
        self.kv_ttl_s = ttl_s + ttl_s // 4
        self.stats = TierStats()
        # Per session: bytes of each key it wrote (a key written again replaces its size) and their sum.
        self._sizes: dict[str, dict[str, int]] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()  # the counters' owner: held for bookkeeping only, never across a call
        self._client = client.redis
        self.writer = secrets.token_hex(6)  # this process, as the manifests name who wrote a key
        self._sweep = Script(self._client, SWEEP)
        self._logged: set[str] = set()  # sessions this writer has logged in ``writing_key`` (under the lock)

    @property
    def healthy(self) -> bool:
        """Whether the last call through this process's Redis connection succeeded."""
        return self.client.healthy

    @property
    def last_error(self) -> str | None:
        return self.client.last_error

    def unavailable(self, session_id: str | None = None) -> bool:
        """Whether a call on the session's keys now would fail at once (its circuit is open, no probe due);
        no session: whether every call would (``RedisClient.unavailable``)."""
        return self.client.unavailable(None if session_id is None else self.manifest_key(session_id))

    # --- keys --------------------------------------------------------------------------------
    def chunk_key(self, session_id: str, chunk_id: str) -> str:
        return kv_key(self.ns, session_id, chunk_id)

    def manifest_key(self, session_id: str) -> str:
        return manifest_key(self.ns, session_id)

    # --- plumbing ----------------------------------------------------------------------------
    def _run(self, session_id: str, coro: Coroutine[Any, Any, Any], default=None):
        """Run on the client's loop (through the circuit of the session's shard) and wait; on failure
        count it and return ``default``."""
        return self._call(self.manifest_key(session_id), coro, default)

    def _call(self, key: str, coro: Coroutine[Any, Any, Any], default=None):
        """``_run`` for a call on ``key``'s shard (the writers' log and liveness are no session's keys)."""
        try:
            return self.client.run(coro, key=key)
        except RedisUnavailable:  # refused at once: the failure that opened the circuit was logged
            self._count_error()
            return default
        except Exception:  # noqa: BLE001 - any Redis failure degrades the tier, never the turn
            self._count_error()
            log.warning("redis tier error: %s", self.client.last_error)
            return default

    def _count_error(self) -> None:
        with self._lock:
            self.stats.errors += 1

    def ping(self) -> bool:
        return self.client.ping()

    # --- tensors -----------------------------------------------------------------------------
    def put_pages(self, session_id: str, pages: dict[str, PageBatch]) -> bool:
        """Store pages (id -> its tensors, no page axis) in one pipelined request; False on failure."""
        if not pages:
            return True
        self._log_writing(session_id)
        encoded = {self.chunk_key(session_id, pid): encode_tensors(t) for pid, t in pages.items()}
        manifest = self.manifest_key(session_id)

        async def op():
            async with self._client.pipeline(transaction=False) as pipe:
                # Named first: a write cut short leaves no key the manifest misses.
                pipe.hset(manifest, mapping=dict.fromkeys(pages, self.writer))
                pipe.expire(manifest, self.kv_ttl_s)
                for key, (header, data) in encoded.items():
                    pipe.hset(key, mapping={"header": header, "data": data})
                    pipe.expire(key, self.kv_ttl_s)
                await pipe.execute()
            return True

        if not self._run(session_id, op(), default=False):
            return False
        self._account_write(session_id, {pid: len(data) for pid, (_, data) in zip(pages, encoded.values())})
        return True

    def get_pages(self, session_id: str, page_ids: list[str]) -> list[PageBatch | None]:
        """Pages by id in one pipelined request; None where a page is missing or Redis is down."""
        if not page_ids:
            return []
        keys = [self.chunk_key(session_id, pid) for pid in page_ids]

        async def op():
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hmget(key, ["header", "data"])
                    pipe.expire(key, self.kv_ttl_s)
                return (await pipe.execute())[::2]

        replies = self._run(session_id, op(), default=None) or [(None, None)] * len(keys)
        out: list[PageBatch | None] = [None if header is None else decode_tensors(header, data)[0]
                                       for header, data in replies]
        found = [len(data) for header, data in replies if header is not None]
        with self._lock:
            self.stats.misses += len(replies) - len(found)
            self.stats.hits += len(found)
            self.stats.promotions += len(found)
            self.stats.bytes_read += sum(found)
        return out

    def renew_pages(self, session_id: str, page_ids: list[str]) -> list[bool] | None:
        """Whether Redis holds each page, renewing the TTL of those it holds (one pipelined request);
        None when Redis cannot be asked. The check a belief "this page is in Redis" gets before it is
        relied on: a key expires, or Redis restarts empty."""
        if not page_ids:
            return []
        keys = [self.chunk_key(session_id, pid) for pid in page_ids]

        async def op():
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.expire(key, self.kv_ttl_s)
                return [bool(r) for r in await pipe.execute()]

        return self._run(session_id, op(), default=None)

    def _account_write(self, session_id: str, written: dict[str, int]) -> None:
        with self._lock:
            sizes = self._sizes.setdefault(session_id, {})
            for pid, nbytes in written.items():
                old = sizes.get(pid)
                if old is None:
                    self.stats.entries += 1
                    self.stats.demotions += 1
                delta = nbytes - (old or 0)
                self.stats.bytes += delta
                self._bytes[session_id] = self._bytes.get(session_id, 0) + delta
                self.stats.bytes_written += nbytes
                sizes[pid] = nbytes

    def _account_delete(self, session_id: str, page_ids: list[str] | None = None) -> None:
        """Stop counting these keys of a session (None: all of them, and the session)."""
        with self._lock:
            sizes = self._sizes.get(session_id, {})
            gone = list(sizes) if page_ids is None else [pid for pid in dict.fromkeys(page_ids) if pid in sizes]
            freed = sum(sizes.pop(pid) for pid in gone)
            self.stats.bytes -= freed
            self.stats.entries -= len(gone)
            if page_ids is None or not sizes:
                self._sizes.pop(session_id, None)
                self._bytes.pop(session_id, None)
            else:
                self._bytes[session_id] -= freed

    def delete_pages(self, session_id: str, page_ids: list[str]) -> None:
        if not page_ids:
            return
        keys = [self.chunk_key(session_id, pid) for pid in page_ids]
        manifest = self.manifest_key(session_id)

        async def op():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.delete(*keys)
                pipe.hdel(manifest, *page_ids)
                await pipe.execute()
            return True

        if self._run(session_id, op(), default=None) is None:
            return
        self._account_delete(session_id, page_ids)

    # --- sessions ----------------------------------------------------------------------------
    def manifest(self, session_id: str) -> set[str] | None:
        """Every name written under the session's KV keys and not deleted since; None if Redis is down."""
        async def op():
            return {m.decode() for m in await self._client.hkeys(self.manifest_key(session_id))}

        return self._run(session_id, op(), default=None)

    def delete_session(self, session_id: str, rounds: int = 4) -> bool:
        """Remove every KV key of the session, by its manifest: exactly the keys written for it, no
        scan. A writer still finishing (a spill that began before the delete) may add names meanwhile,
        so the manifest is read again until it is empty. False when Redis failed (keys left for their
        TTL)."""
        manifest = self.manifest_key(session_id)

        async def op():
            for _ in range(rounds):
                names = [m.decode() for m in await self._client.hkeys(manifest)]
                if not names:
                    return True
                async with self._client.pipeline(transaction=False) as pipe:
                    for i in range(0, len(names), 512):
                        part = names[i : i + 512]
                        pipe.delete(*(self.chunk_key(session_id, n) for n in part))
                        pipe.hdel(manifest, *part)
                    await pipe.execute()
            return not await self._client.exists(manifest)

        done = bool(self._run(session_id, op(), default=False))
        self._account_delete(session_id)
        if done:
            self._unlog(session_id)
        return done

    def forget_session(self, session_id: str) -> None:
        """Stop counting a session that leaves this process; its keys stay, for whoever restores it, and it
        leaves this writer's log (what it wrote is named by its record, or was collected on leaving)."""
        self._account_delete(session_id)
        self._unlog(session_id)

    # --- writers -----------------------------------------------------------------------------
    def _unlog(self, session_id: str) -> None:
        """The session leaves this writer (its keys named by its record, collected, or deleted)."""
        with self._lock:
            logged = session_id in self._logged
            self._logged.discard(session_id)
        if logged:
            self._drop_entry(self.writer, session_id)

    def _drop_entry(self, writer: str, session_id: str) -> None:
        """Take ``writer``'s entry for the session out of the writers' log."""
        key = writing_key(self.ns)

        async def op():
            return await self._client.zrem(key, f"{writer}|{session_id}")

        self._call(key, op())

    def _log_writing(self, session_id: str) -> None:
        """Before this writer's first write for a session: log it (and that this writer lives), so that if
        it dies what it leaves is found. Redis failing, it is not logged: tried again at the next write."""
        with self._lock:
            if session_id in self._logged:
                return
        if not self.keep_alive():
            return
        key = writing_key(self.ns)

        async def op():
            await self._client.zadd(key, {f"{self.writer}|{session_id}": 0})
            return True

        if self._call(key, op(), default=False):
            with self._lock:
                self._logged.add(session_id)

    def keep_alive(self, ttl_s: int = WRITER_TTL_S) -> bool:
        """Say this writer lives for ``ttl_s`` more seconds (renewed well before: ``app.chat_service``).
        Found lapsed (this process was taken for dead, its log entries maybe swept): every session is
        logged again at its next write."""
        key = writer_key(self.ns, self.writer)

        async def op():
            return await self._client.set(key, b"1", ex=ttl_s, get=True)

        before = self._call(key, op(), default=False)
        if before is False:
            return False
        if before is None:
            with self._lock:
                self._logged.clear()
        return True

    def own(self, session_id: str, names: list[str]) -> bool:
        """Take over names another writer wrote (a restore adopting its generation): this writer keeps them
        while it lives, whatever became of that one."""
        if not names:
            return True
        self._log_writing(session_id)
        manifest = self.manifest_key(session_id)

        async def op():
            await self._client.hset(manifest, mapping=dict.fromkeys(names, self.writer))
            return True

        return bool(self._run(session_id, op(), default=False))

    def dead_writings(self) -> list[tuple[str, str]]:
        """(writer, session) of the log whose writer no longer lives; [] when Redis cannot tell."""
        key = writing_key(self.ns)

        async def entries():
            return [m.decode().split("|", 1) for m in await self._client.zrange(key, 0, -1)]

        logged = self._call(key, entries(), default=None) or []
        dead = []
        for writer in {w for w, _ in logged if w != self.writer}:
            alive = writer_key(self.ns, writer)

            async def exists(alive=alive):
                return await self._client.exists(alive)

            if self._call(alive, exists(), default=1) == 0:
                dead.append(writer)
        return [(w, sid) for w, sid in logged if w in dead]

    def sweep_writer(self, session_id: str, writer: str, named: set[str]) -> int | None:
        """Delete the session's keys that ``writer`` (dead) wrote last and that ``named`` (what its record
        names) lacks, then its log entry; the names deleted, or None when Redis failed."""
        manifest = self.manifest_key(session_id)

        async def op():
            # One script on the session's slot: a name another writer took over meanwhile is not deleted.
            return await self._sweep([manifest], [writer, self.chunk_key(session_id, ""), *sorted(named)])

        swept = self._run(session_id, op(), default=None)
        if swept is not None:
            self._drop_entry(writer, session_id)
        return swept

    def session_bytes(self, session_id: str) -> int:
        """Bytes this process wrote for the session and still counts: one lookup, safe from any thread."""
        return self._bytes.get(session_id, 0)

    def close(self) -> None:
        """Close the tier's connection; the session records share it, so this comes last."""
        self.client.close()
