"""Host tier: a bounded pool of page slots in CPU memory; least recently used pages spill to Redis.

The pool is one tensor per page field with a slot axis, pinned when CUDA is present so copies to the
device can be asynchronous. Pages are written and read in batches by slot index: a read gathers its
pages into a new tensor, so nothing it returns aliases a slot that a later write may reuse.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import Counter, OrderedDict

import torch

from tiers.base import PageBatch, TierStats
from tiers.redis_tier import RedisTier

log = logging.getLogger(__name__)
PageKey = tuple[str, str]  # (session id, page id)


def one_at_a_time(method):
    """Run a tier method under the tier's lock: the page reader may demote one session's pages while
    the model thread reads another's (``ReselectTiered`` settles a layer beside the next one)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class ChunkUnavailable(KeyError):
    """A cold page is neither in host memory nor readable from Redis (not there, or Redis is down)."""


class HostTier:
    def __init__(self, capacity_bytes: int, redis: RedisTier | None = None, pin: bool | None = None):
        self.capacity_bytes = capacity_bytes
        self.redis = redis
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.stats = TierStats()
        self.overflow_slots = 0  # slots allocated past the bound because nothing could spill
        self._pool: PageBatch = {}
        self._page_bytes = 0
        self._slots = 0  # slots allocated (the pool tensors may hold more rows)
        self._free: list[int] = []
        self._resident: OrderedDict[PageKey, int] = OrderedDict()
        self._in_redis: set[PageKey] = set()
        self._per_session: Counter[str] = Counter()
        self._lock = threading.RLock()

    # --- slots -------------------------------------------------------------------------------
    @property
    def max_slots(self) -> int:
        return max(1, self.capacity_bytes // self._page_bytes) if self._page_bytes else 0

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def _check_layout(self, batch: PageBatch) -> None:
        if not self._pool:
            self._page_bytes = sum(t[0].numel() * t.element_size() for t in batch.values())
            # The whole bound at once, as the first page shows the layout: growing it page batch by
            # page batch copied the pool again and again (most of a long first turn's demotion). On a
            # CPU the untouched rows cost no memory; pinned, the bound is taken once at start.
            self._pool = {k: torch.empty(self.max_slots, *t.shape[1:], dtype=t.dtype, pin_memory=self.pin)
                          for k, t in batch.items()}
            return
        for name, t in batch.items():
            ref = self._pool.get(name)
            if ref is None or ref.shape[1:] != t.shape[1:] or ref.dtype != t.dtype or len(batch) != len(self._pool):
                raise ValueError("every page in the host tier has the same fields, shapes and dtypes")

    def _grow_to(self, rows: int) -> None:
        """Make the pool tensors hold at least ``rows`` slots."""
        have = next(iter(self._pool.values())).shape[0]
        if rows <= have:
            return
        target = max(rows, have + max(have // 2, 64))  # only past the bound (overflow): geometric
        for name, old in self._pool.items():
            new = torch.empty(target, *old.shape[1:], dtype=old.dtype, pin_memory=self.pin)
            new[:have] = old
            self._pool[name] = new

    def _take_slots(self, n: int, protect: set[PageKey]) -> list[int]:
        slots = [self._free.pop() for _ in range(min(n, len(self._free)))]
        fresh = min(n - len(slots), max(0, self.max_slots - self._slots))
        if n - len(slots) - fresh > 0:
            slots += self._spill_lru(n - len(slots) - fresh, protect)
        fresh = n - len(slots)
        if self._slots + fresh > self.max_slots:
            self.overflow_slots += self._slots + fresh - max(self.max_slots, self._slots)
        self._grow_to(self._slots + fresh)
        slots += list(range(self._slots, self._slots + fresh))
        self._slots += fresh
        return slots

    def _spill_lru(self, n: int, protect: set[PageKey]) -> list[int]:
        """Move up to n least recently used pages to Redis (one pipelined write); their freed slots."""
        if self.redis is None:
            return []
        victims = []
        for key in self._resident:
            if len(victims) == n:
                break
            if key not in protect:
                victims.append(key)
        missing = [k for k in victims if k not in self._in_redis]
        if missing:
            by_session: dict[str, dict[str, PageBatch]] = {}
            for key in missing:
                by_session.setdefault(key[0], {})[key[1]] = self._row(self._resident[key])
            for sid, pages in by_session.items():
                if not self.redis.put_pages(sid, pages):
                    return []
            self._in_redis.update(missing)
        freed = []
        for key in victims:
            freed.append(self._resident.pop(key))
            self._per_session[key[0]] -= 1
        self.stats.spills += len(victims)
        self.stats.entries -= len(victims)
        self.stats.bytes -= len(victims) * self._page_bytes
        return freed

    def _row(self, slot: int) -> PageBatch:
        return {name: t[slot].clone() for name, t in self._pool.items()}

    # --- pages -------------------------------------------------------------------------------
    @one_at_a_time
    def put_many(self, session_id: str, page_ids: list[str], batch: PageBatch) -> int:
        """Store pages demoted from the device (copied into slots); returns the bytes written."""
        nbytes = self._store(session_id, page_ids, batch)
        self.stats.demotions += len(page_ids)
        self.stats.bytes_written += nbytes
        return nbytes

    @torch.inference_mode()
    def _store(self, session_id: str, page_ids: list[str], batch: PageBatch) -> int:
        # Inference mode: pool rows written during a model step are inference tensors, writable only there.
        if not page_ids:
            return 0
        self._check_layout(batch)
        step = self.max_slots
        if len(page_ids) > step:  # a batch larger than the pool: each part spills the one before it
            return sum(
                self._store(session_id, page_ids[i : i + step], {k: t[i : i + step] for k, t in batch.items()})
                for i in range(0, len(page_ids), step)
            )
        keys = [(session_id, pid) for pid in page_ids]
        slots = self._take_slots(len(keys), set(keys))
        index = torch.tensor(slots, dtype=torch.long)
        for name, t in batch.items():
            self._pool[name].index_copy_(0, index, t.to(self._pool[name].dtype).cpu())
        for key, slot in zip(keys, slots):
            self._resident[key] = slot
        self._per_session[session_id] += len(keys)
        nbytes = len(keys) * self._page_bytes
        self.stats.entries += len(keys)
        self.stats.bytes += nbytes
        return nbytes

    @one_at_a_time
    @torch.inference_mode()
    def read_many(self, session_id: str, page_ids: list[str]) -> tuple[PageBatch, int]:
        """Copies of the pages, in order, and the bytes of them that came from Redis.

        Pages spilled to Redis come back in one pipelined request and are stored in the pool again
        (a promotion into this tier); raises ``ChunkUnavailable`` when a page can be read nowhere.
        """
        keys = [(session_id, pid) for pid in page_ids]
        hits = [(i, self._resident[k]) for i, k in enumerate(keys) if k in self._resident]
        misses = [i for i, k in enumerate(keys) if k not in self._resident]
        fetched: list[PageBatch | None] = []
        if misses:
            if self.redis is None or any(keys[i] not in self._in_redis for i in misses):
                raise ChunkUnavailable(f"page {keys[misses[0]]} is in no tier that can be read now")
            fetched = self.redis.get_pages(session_id, [keys[i][1] for i in misses])
            if any(page is None for page in fetched):
                raise ChunkUnavailable(f"a page of session {session_id} is in no tier that can be read now")
        if not self._pool:
            self._check_layout({k: t.unsqueeze(0) for k, t in fetched[0].items()})
        out = {name: torch.empty(len(keys), *t.shape[1:], dtype=t.dtype, pin_memory=self.pin)
               for name, t in self._pool.items()}
        if hits:
            slots = torch.tensor([s for _, s in hits], dtype=torch.long)
            # With no misses the hits are every page, in order: selected straight into the output (one
            # copy, not a selection then a copy into place), and no positions to place them at.
            at = torch.tensor([i for i, _ in hits], dtype=torch.long) if misses else None
            for name, t in self._pool.items():
                if at is None:
                    torch.index_select(t, 0, slots, out=out[name])
                else:
                    out[name].index_copy_(0, at, t.index_select(0, slots))
            for i, _ in hits:
                self._resident.move_to_end(keys[i])
            self.stats.hits += len(hits)
        if misses:
            at = torch.tensor(misses, dtype=torch.long)
            for name in out:
                out[name].index_copy_(0, at, torch.stack([page[name] for page in fetched]))
            self.stats.misses += len(misses)
            self.stats.promotions += len(misses)
            promoted = [keys[i][1] for i in misses]
            self._store(session_id, promoted, {name: t.index_select(0, at) for name, t in out.items()})
            self._in_redis.update((session_id, pid) for pid in promoted)
        self.stats.bytes_read += len(keys) * self._page_bytes
        return out, len(misses) * self._page_bytes

    @one_at_a_time
    def free_many(self, session_id: str, page_ids: list[str]) -> None:
        """Forget pages everywhere (host slots and Redis copies)."""
        in_redis = []
        for pid in page_ids:
            key = (session_id, pid)
            slot = self._resident.pop(key, None)
            if slot is not None:
                self._free.append(slot)
                self._per_session[session_id] -= 1
                self.stats.entries -= 1
                self.stats.bytes -= self._page_bytes
            if key in self._in_redis:
                self._in_redis.discard(key)
                in_redis.append(pid)
        if in_redis and self.redis is not None:
            self.redis.delete_pages(session_id, in_redis)

    @one_at_a_time
    def drop_session(self, session_id: str) -> int:
        """Give back the slots of a session leaving this process, keeping its Redis copies.

        Unlike ``free_many``, nothing is deleted from Redis: the session's stored record (which another
        replica, or this one later, restores) still refers to those pages. Returns the slots freed.
        """
        keys = [key for key in self._resident if key[0] == session_id]
        for key in keys:
            self._free.append(self._resident.pop(key))
        self.stats.entries -= len(keys)
        self.stats.bytes -= len(keys) * self._page_bytes
        self._per_session.pop(session_id, None)
        self._in_redis.difference_update([key for key in self._in_redis if key[0] == session_id])
        return len(keys)

    @one_at_a_time
    def persist_many(self, session_id: str, page_ids: list[str]) -> int | None:
        """Make sure Redis holds a copy of these pages (one pipelined write of those it lacks).

        Returns the bytes written, or None when Redis is unavailable or a page is held nowhere."""
        keys = [(session_id, pid) for pid in page_ids if (session_id, pid) not in self._in_redis]
        if not keys:
            return 0
        if self.redis is None or any(k not in self._resident for k in keys):
            return None
        pages = {k[1]: self._row(self._resident[k]) for k in keys}
        if not self.redis.put_pages(session_id, pages):
            return None
        self._in_redis.update(keys)
        return len(keys) * self._page_bytes

    @one_at_a_time
    def adopt_many(self, session_id: str, page_ids: list[str]) -> None:
        """Record pages that Redis already holds (a session restored by another process)."""
        self._in_redis.update((session_id, pid) for pid in page_ids)

    @one_at_a_time
    def where(self, session_id: str, page_id: str) -> str:
        key = (session_id, page_id)
        if key in self._resident:
            return "host"
        return "redis" if key in self._in_redis else "none"

    @one_at_a_time
    def where_many(self, session_id: str, page_ids: list[str]) -> list[str]:
        """``where`` of many pages under one hold of the lock (the memory map asks for every page)."""
        resident, in_redis = self._resident, self._in_redis
        return ["host" if (session_id, pid) in resident else "redis" if (session_id, pid) in in_redis else "none"
                for pid in page_ids]

    @one_at_a_time
    def session_bytes(self, session_id: str) -> int:
        return self._page_bytes * self._per_session.get(session_id, 0)
