"""Host tier: which cold pages of this process sit in host memory (``tiers.host_pool``), which have a copy
in Redis, and the policy that moves them: least recently used pages spill to Redis to make room.

The pool is a hard bound. A store that finds no free slot spills least recently used pages to Redis;
with no Redis, or while its circuit is open (``tiers.breaker``), nothing can spill and the store fails
with ``HostFull``, storing nothing. Admission keeps that from happening mid-turn: a turn first
``reserve``s the slots it may fill, which other sessions' stores then leave alone.

One lock guards the index, the counters and the pool, and no call to Redis is ever made under it: a
spill marks its pages as spilling and copies them under the lock, writes them with the lock released,
and frees their slots under it again; reads, persists and frees likewise talk to Redis between two
holds. So the page reader may demote one session's pages while the model thread reads another's, and
a Redis that does not answer stalls only the caller that waits on it. Which pages Redis holds, and
which KV generations name them, is ``tiers.redis_copies``' bookkeeping, kept under the same lock: a
copy a generation names outlives its page's free, and a belief that Redis holds a page is checked
before a spill or a persist relies on it. Called by ``tiers.cold_layer`` (pages), ``tiers.session_kv``
(generations), the engine (admission, dropping a session) and the replica's status (counters).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from tiers.base import PageBatch, TierStats
from tiers.host_pool import HostPool
from tiers.redis_copies import Collected, RedisCopies
from tiers.redis_tier import RedisTier
from tiers.store_order import StoreOrder

log = logging.getLogger(__name__)
PageKey = tuple[str, str]  # (session id, page id)
# Spills in a row that free no slot (their writes landed nothing, or the pages went meanwhile) a store may try.
MAKE_ROOM_ROUNDS = 4
# Longest a store waits, in all, for other stores in flight to land their pages so that it can spill
# them: each spill's Redis write is bounded by the client's timeout, so only a fault lasts this long.
LAND_WAIT_S = 30.0


class ChunkUnavailable(KeyError):
    """A cold page is neither in host memory nor readable from Redis (not there, or Redis is down)."""


class HostFull(RuntimeError):
    """No host slot for a page: the bound is reached and nothing can spill (no Redis, or it is failing)."""


class HostTier:
    def __init__(self, capacity_bytes: int, redis: RedisTier | None = None, pin: bool | None = None,
                 page_bytes: int | None = None):
        """``page_bytes``: one page's size when known ahead (admission then knows the bound in slots
        before the first page arrives)."""
        self.capacity_bytes = capacity_bytes
        self.redis = redis
        self.pool = HostPool(capacity_bytes, torch.cuda.is_available() if pin is None else pin, page_bytes)
        self.stats = TierStats()
        self.refused = 0  # reservations refused: the turns they were for never ran
        self.exhausted = 0  # stores refused for want of a slot
        self._resident: OrderedDict[PageKey, int] = OrderedDict()  # pages in a slot, least recently used first
        self._spilling: dict[PageKey, int] = {}  # pages being written to Redis: their slots stay theirs until then
        self._doomed: set[PageKey] = set()  # spilling pages freed meanwhile: their Redis copy goes too
        self._pages: dict[str, set[str]] = {}  # per session: its pages in a slot (resident or spilling)
        self.copies = RedisCopies()  # which pages Redis holds, which generations name them (under the lock)
        # Per holder (a session's turn in flight, by session id, or what was set aside for a job of an
        # ended turn): its session, and the slots it may still fill.
        self._reserved: dict[str, tuple[str, int]] = {}
        self._lock = threading.RLock()
        # Stores between taking slots (or spilling for them) and writing their pages: while one is, the
        # pages that will make way for another store are its, not yet resident.
        self._order = StoreOrder(self._lock)

    @property
    def waits(self) -> int:
        """Times a store waited for others in flight to land pages it could spill."""
        return self._order.waits

    @property
    def max_slots(self) -> int:
        return self.pool.max_slots

    @property
    def page_bytes(self) -> int:
        return self.pool.page_bytes

    def _can_spill(self) -> bool:
        return self.redis is not None and not self.redis.unavailable()

    # --- admission ---------------------------------------------------------------------------
    def reserve(self, session_id: str, pages: int) -> bool:
        """Hold free slots for up to ``pages`` pages that a session's turn may demote, replacing what the
        turn held (not what ``set_aside`` moved); False (the turn holding nothing) when they are not free
        beside what others hold. While pages can spill to Redis nothing needs holding: any resident page
        can make way."""
        with self._lock:
            self._reserved.pop(session_id, None)
            if pages <= 0 or self._can_spill():
                return True
            # Room set aside for a job of the session's earlier turn is not this turn's to count on.
            if pages > self._free_beside({session_id}):
                self.refused += 1
                return False
            self._reserved[session_id] = (session_id, pages)
            return True

    def set_aside(self, session_id: str, holder: str) -> None:
        """The slots a session's turn holds stay held under ``holder`` (for a job of that turn still to
        run), apart from the session's next turn, until ``release(holder)``; the session's stores fill
        them as they fill the turn's."""
        with self._lock:
            held = self._reserved.pop(session_id, None)
            if held is not None:
                self._reserved[holder] = held

    def release(self, holder: str) -> None:
        """A session's turn (a session id), or what was set aside for a job of it, ended: the slots it
        held and did not fill are free for others."""
        with self._lock:
            self._reserved.pop(holder, None)
            self._progressed()

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._reserved.values()) * self.page_bytes

    def free_bytes(self) -> int:
        """Bytes of the free slots (those held for turns in flight included)."""
        with self._lock:
            return self.pool.free_count() * self.page_bytes

    def _room(self, session_id: str) -> int:
        """Free slots a session's store may take: those not held for other sessions' turns."""
        return self._free_beside(set(self._holders(session_id)))

    def _free_beside(self, own: set[str]) -> int:
        """Free slots not held by holders other than ``own``."""
        others = sum(n for holder, (_, n) in self._reserved.items() if holder not in own)
        return max(0, self.pool.free_count() - others)

    def _holders(self, session_id: str) -> list[str]:
        """A session's holders, in the order they began holding."""
        return [holder for holder, (sid, _) in self._reserved.items() if sid == session_id]

    # --- making room -------------------------------------------------------------------------
    def _make_room(self, session_id: str, n: int, protect: set[PageKey], required: bool, ticket: int) -> list[int]:
        """``n`` slots for a session's pages: free ones first, then those of least recently used pages
        spilled to Redis (not ``protect``). Short of ``n``: ``HostFull`` when ``required``, else the
        slots it found."""
        got: list[int] = []
        try:
            short = self._fill(session_id, n, protect, required, got, ticket)
        except BaseException:
            with self._lock:
                self.pool.give_back(got)
                self._progressed()
            raise
        if short is not None and required:
            with self._lock:
                self.pool.give_back(got)
                self.exhausted += 1
                self._progressed()
            raise HostFull(f"the host tier is full ({self.capacity_bytes} bytes) and {short}: "
                           f"{n} more pages of {self.page_bytes} bytes do not fit")
        return got

    def _fill(self, session_id: str, n: int, protect: set[PageKey], required: bool, got: list[int], ticket: int
              ) -> str | None:
        """Add slots to ``got`` (in place, so that a failure can give them back) up to ``n``; returns
        None when it has them, else why it stopped short."""
        rounds, deadline = 0, time.monotonic() + LAND_WAIT_S
        spilled_for = 0  # slots in ``got`` that its own spills freed: news to other stores when given back
        while True:
            writes: dict[str, dict[str, PageBatch]] = {}
            checks: dict[str, list[str]] = {}
            with self._lock:
                got += self.pool.take(min(n - len(got), self._room(session_id)))
                if len(got) == n:
                    return None
                if self.redis is None:
                    return "no Redis to spill to"
                if not self._can_spill():
                    return f"Redis is unavailable ({self.redis.last_error})"
                if rounds == MAKE_ROOM_ROUNDS:
                    return "its spills freed no slot"
                self._start_spill(n - len(got), protect, writes, checks)
                if not writes:
                    # Every page that could make way is another store's, spilling or not yet landed. A
                    # required store waits for one to land and spills its pages; a promotion (best
                    # effort, on a reader's path) keeps what it has.
                    if not required or not self._order.others_landing(bool(self._spilling), holding=True):
                        held = self.pool.free_count() > 0  # free, but held for other sessions' turns
                        return "its free slots are held for other turns" if held else "no page in it can spill"
                    if got and not self._order.oldest(ticket):  # only the oldest waits holding slots
                        self.pool.give_back(got)
                        got.clear()
                        if spilled_for:  # slots taken from the free list were there for the others already
                            self._progressed()
                        spilled_for = 0
                    if not self._order.wait(bool(got), deadline, lambda: bool(self._spilling)):
                        return "the stores in flight did not land"
                    continue
            written: dict[str, bool] = {}
            try:
                for sid, pages in writes.items():
                    written[sid] = self._write_spill(sid, pages, checks.get(sid, []))
            finally:  # a write that raised leaves its pages resident, not spilling for good
                with self._lock:
                    freed, orphans = self._end_spill(writes, {sid: written.get(sid, False) for sid in writes})
                    got += freed
                    spilled_for += len(freed)
                    rounds = 0 if freed else rounds + 1
                    self._progressed()
            for sid, pids in orphans.items():
                self.redis.delete_pages(sid, pids)
            if not all(written.values()):
                return f"spilling to Redis failed ({self.redis.last_error})"

    def _progressed(self) -> None:
        """Under the lock: slots came free or pages landed (resident, so they may spill)."""
        self._order.progressed()

    def _start_spill(self, k: int, protect: set[PageKey], writes: dict[str, dict[str, PageBatch]],
                     checks: dict[str, list[str]]) -> None:
        """Under the lock: evict up to ``k`` least recently used pages: each is marked spilling and copied
        into ``writes`` (session -> page -> tensors), for ``_write_spill`` and then ``_end_spill``. Those
        Redis is believed to hold go in ``checks``: the belief is checked before their slot is let go."""
        victims = []
        for key in self._resident:
            if len(victims) == k:
                break
            if key not in protect:
                victims.append(key)
        for key in victims:
            self._spilling[key] = self._resident.pop(key)
            if self.copies.holds(*key):
                checks.setdefault(key[0], []).append(key[1])
        for key, page in zip(victims, self.pool.copies([self._spilling[key] for key in victims])):
            writes.setdefault(key[0], {})[key[1]] = page

    def _write_spill(self, session_id: str, pages: dict[str, PageBatch], believed: list[str]) -> bool:
        """With the lock released: write a session's spilled pages, but those Redis does hold of the
        ones it is believed to (their TTL renewed on the way)."""
        found = self.redis.renew_pages(session_id, believed)
        if found is None:
            return False
        present = {pid for pid, ok in zip(believed, found) if ok}
        return self.redis.put_pages(session_id, {pid: page for pid, page in pages.items() if pid not in present})

    def _end_spill(self, writes: dict[str, dict[str, PageBatch]], written: dict[str, bool]
                   ) -> tuple[list[int], dict[str, list[str]]]:
        """Under the lock, after a spill's writes: the slots they freed, and the Redis copies of pages freed
        meanwhile (to delete). A page whose write failed stays resident, first to go next time."""
        freed: list[int] = []
        orphans: dict[str, list[str]] = {}
        for sid, pages in writes.items():
            ok = written[sid]
            for pid in pages:
                key = (sid, pid)
                slot = self._spilling.pop(key)
                if pid not in self._pages.get(sid, ()):  # freed or dropped while it was written
                    freed.append(slot)
                    if key in self._doomed:
                        self._doomed.discard(key)
                        if ok:  # its copy goes now, unless a generation names it
                            orphans.setdefault(sid, []).extend(self.copies.written_after_free(sid, [pid]))
                elif ok:
                    freed.append(slot)
                    self.copies.add(sid, [pid])
                    self._forget_host_page(key)
                    self.stats.spills += 1
                else:
                    self._resident[key] = slot
                    self._resident.move_to_end(key, last=False)
        return freed, orphans

    def _forget_host_page(self, key: PageKey) -> None:
        """A page no longer has a slot (its slot went elsewhere): the counters say so."""
        mine = self._pages.get(key[0])
        if mine is not None:
            mine.discard(key[1])
            if not mine:
                del self._pages[key[0]]
        self.stats.entries -= 1
        self.stats.bytes -= self.page_bytes

    # --- pages -------------------------------------------------------------------------------
    def put_many(self, session_id: str, page_ids: list[str], batch: PageBatch) -> int:
        """Store pages demoted from the device (copied into slots); returns the bytes written. All or
        nothing: ``HostFull`` when they do not fit and cannot spill (none of them is then stored)."""
        if not page_ids:
            return 0
        with self._lock:
            self.pool.lay_out(batch)
        step = self.max_slots  # a batch larger than the pool: each part spills the one before it
        stored: list[str] = []
        try:
            for i in range(0, len(page_ids), step):
                part = page_ids[i : i + step]
                self._store(session_id, part, {k: t[i : i + step] for k, t in batch.items()}, required=True)
                stored += part
        except HostFull:
            self.free_many(session_id, stored)
            raise
        nbytes = len(page_ids) * self.page_bytes
        with self._lock:
            self.stats.demotions += len(page_ids)
            self.stats.bytes_written += nbytes
        return nbytes

    def _fill_reserved(self, session_id: str, n: int) -> None:
        """Under the lock: ``n`` slots a session's store filled count against what it held, first what was
        set aside (the earlier turn's job runs before the next turn's demotions), then its turn's."""
        for holder in self._holders(session_id):
            if holder != session_id:
                n = self._take_reserved(holder, n)
        self._take_reserved(session_id, n)

    def _take_reserved(self, holder: str, n: int) -> int:
        sid, held = self._reserved.get(holder, ("", 0))
        if held:
            self._reserved[holder] = (sid, max(0, held - n))
        return max(0, n - held)

    @torch.inference_mode()
    def _store(self, session_id: str, page_ids: list[str], batch: PageBatch, required: bool) -> int:
        """Copy pages into slots (made room for); without ``required`` only the first ones that fit.
        Returns how many were stored. Inference mode: pool rows written during a model step are
        inference tensors, writable only there."""
        keys = [(session_id, pid) for pid in page_ids]
        with self._lock:
            ticket = self._order.begin()
        try:
            slots = self._make_room(session_id, len(keys), set(keys), required, ticket)
            return self._land(session_id, keys, batch, slots, promoted=not required)
        finally:
            with self._lock:
                self._order.end(ticket)

    def _land(self, session_id: str, keys: list[PageKey], batch: PageBatch, slots: list[int], promoted: bool) -> int:
        """Write the first ``len(slots)`` pages into the slots made for them; returns how many it tried.
        A page already spilling (another reader promoted it too) is skipped, and so is a ``promoted`` page
        (read back from Redis) that was freed while it was read: it must not come back."""
        if not slots:
            return 0
        n = len(slots)
        with self._lock:
            try:
                self.pool.write(slots, {k: t[:n] for k, t in batch.items()})
            except BaseException:
                self.pool.give_back(slots)
                raise
            mine = self._pages.setdefault(session_id, set())
            landed = 0
            for key, slot in zip(keys, slots):
                if key in self._spilling or (promoted and not self.copies.holds(*key)):
                    self.pool.give_back([slot])
                    continue
                old = self._resident.pop(key, None)
                if old is not None:  # the same page written again: its old slot is free
                    self.pool.give_back([old])
                    self.stats.entries -= 1
                    self.stats.bytes -= self.page_bytes
                self._resident[key] = slot
                mine.add(key[1])
                landed += 1
            self._fill_reserved(session_id, landed)
            self.stats.entries += landed
            self.stats.bytes += landed * self.page_bytes
        return n

    @torch.inference_mode()
    def read_many(self, session_id: str, page_ids: list[str]) -> tuple[PageBatch, int]:
        """Copies of the pages, in order, and the bytes of them that came from Redis.

        Pages spilled to Redis come back in one pipelined request (with the lock released) and are
        stored in the pool again where there is room (a promotion into this tier); raises
        ``ChunkUnavailable`` when a page can be read nowhere."""
        keys = [(session_id, pid) for pid in page_ids]
        out: PageBatch | None = None
        with self._lock:
            slots = [self._resident.get(key, self._spilling.get(key)) for key in keys]
            misses = [i for i, slot in enumerate(slots) if slot is None]
            if misses and (self.redis is None or any(not self.copies.holds(*keys[i]) for i in misses)):
                raise ChunkUnavailable(f"page {keys[misses[0]]} is in no tier that can be read now")
            hits = [(i, slot) for i, slot in enumerate(slots) if slot is not None]
            if hits:
                out = self.pool.empty(len(keys))
                self.pool.gather([s for _, s in hits], out, [i for i, _ in hits] if misses else None)
                for i, _ in hits:
                    if keys[i] in self._resident:
                        self._resident.move_to_end(keys[i])
                self.stats.hits += len(hits)
        if misses:
            fetched = self.redis.get_pages(session_id, [keys[i][1] for i in misses])
            if any(page is None for page in fetched):
                raise ChunkUnavailable(f"a page of session {session_id} is in no tier that can be read now")
            if out is None:
                with self._lock:
                    self.pool.lay_out({k: t.unsqueeze(0) for k, t in fetched[0].items()})
                    out = self.pool.empty(len(keys))
            at = torch.tensor(misses, dtype=torch.long)
            for name in out:
                out[name].index_copy_(0, at, torch.stack([page[name] for page in fetched]))
            with self._lock:
                self.stats.misses += len(misses)
                self.stats.promotions += len(misses)
                kept = [i for i in misses if self.copies.holds(*keys[i])]  # not those freed while read
            # Best effort: a page that finds no room stays in Redis only.
            if kept:
                at = torch.tensor(kept, dtype=torch.long)
                self._store(session_id, [keys[i][1] for i in kept], {n: t.index_select(0, at) for n, t in out.items()},
                            required=False)
        with self._lock:
            self.stats.bytes_read += len(keys) * self.page_bytes
        return out, len(misses) * self.page_bytes

    def free_many(self, session_id: str, page_ids: list[str]) -> None:
        """Forget pages everywhere: their host slots, and their Redis copies that no KV generation names
        (``tiers.redis_copies``; the others go when the generation naming them is superseded)."""
        with self._lock:
            mine = self._pages.get(session_id, set())
            for pid in page_ids:
                key = (session_id, pid)
                if pid in mine:
                    slot = self._resident.pop(key, None)
                    if slot is None:  # being spilled: its slot comes back, and its copy goes, when the write ends
                        self._doomed.add(key)
                    else:
                        self.pool.give_back([slot])
                    self._forget_host_page(key)
            self._progressed()
            in_redis = self.copies.free(session_id, page_ids)
        if in_redis and self.redis is not None:
            self.redis.delete_pages(session_id, in_redis)

    def _drop_slots(self, session_id: str) -> int:
        """Under the lock: give back every slot of a session (one being spilled gives its slot back when
        its write ends); returns how many."""
        mine = self._pages.pop(session_id, set())
        for pid in mine:
            slot = self._resident.pop((session_id, pid), None)
            if slot is None:
                self._doomed.add((session_id, pid))
            else:
                self.pool.give_back([slot])
        self.stats.entries -= len(mine)
        self.stats.bytes -= len(mine) * self.page_bytes
        for holder in self._holders(session_id):
            del self._reserved[holder]
        self._progressed()
        return len(mine)

    def drop_session(self, session_id: str) -> int:
        """Give back the slots of a session leaving this process, keeping the Redis copies its KV
        generations name (the record another replica, or this one later, restores from); copies no
        generation names are deleted. Returns the slots freed."""
        with self._lock:
            freed = self._drop_slots(session_id)
            gone = self.copies.leave(session_id)
        if self.redis is not None:
            self.redis.delete_pages(session_id, gone.names())
            self.redis.forget_session(session_id)
        return freed

    def forget_session(self, session_id: str) -> int:
        """A deleted session: give back its slots and forget its copies (its Redis keys are removed by
        its manifest, ``RedisTier.delete_session``). Returns the slots freed."""
        with self._lock:
            freed = self._drop_slots(session_id)
            self.copies.forget(session_id)
        return freed

    def persist_many(self, session_id: str, page_ids: list[str], verify: bool = True) -> int | None:
        """Make sure Redis holds a copy of these pages: with ``verify``, those it is believed to hold are
        checked (and their TTL renewed); the others, and any found missing, are written from their host
        slots, with the lock released. Returns the bytes written, or None when Redis is unavailable or a
        page is held nowhere."""
        if self.redis is None:
            return None
        with self._lock:
            believed = self.copies.believed(session_id, page_ids) if verify else []
        found = self.redis.renew_pages(session_id, believed)
        if found is None:
            return None
        lost = [pid for pid, ok in zip(believed, found) if not ok]
        with self._lock:
            self.copies.lost(session_id, lost)
            missing = [pid for pid in page_ids if not self.copies.holds(session_id, pid)]
            if not missing:
                return 0
            slots = [self._resident.get((session_id, pid), self._spilling.get((session_id, pid))) for pid in missing]
            if any(slot is None for slot in slots):
                return None
            pages = dict(zip(missing, self.pool.copies(slots)))
        if not self.redis.put_pages(session_id, pages):
            return None
        with self._lock:
            mine = self._pages.get(session_id, ())
            self.copies.add(session_id, [pid for pid in pages if pid in mine])
        return len(pages) * self.page_bytes

    # --- generations (``tiers.session_kv``) ----------------------------------------------------
    def hold(self, session_id: str, gen: str, layers: int, page_ids: list[str]) -> None:
        with self._lock:
            self.copies.hold(session_id, gen, layers, page_ids)

    def adopt(self, session_id: str, gen: str, layers: int, page_ids: list[str]) -> None:
        """Record a generation that Redis holds (a session restored from its record)."""
        with self._lock:
            self.copies.adopt(session_id, gen, layers, page_ids)

    def commit(self, session_id: str, gen: str | None) -> Collected:
        with self._lock:
            return self.copies.commit(session_id, gen)

    def abandon(self, session_id: str, gen: str) -> Collected:
        with self._lock:
            return self.copies.abandon(session_id, gen)

    def due_renewal(self, session_id: str, every_s: float) -> bool:
        with self._lock:
            return self.copies.due_renewal(session_id, every_s)

    def distrust(self, session_id: str) -> None:
        with self._lock:
            self.copies.distrust(session_id)

    def renewed(self, session_id: str) -> None:
        with self._lock:
            self.copies.renewed(session_id)

    def kept(self, session_id: str) -> tuple[set[str], dict[str, int]]:
        """The pages whose Redis copies this process still needs (a page in a slot too: a spill or a persist
        may be writing it), and its generations (id -> layers)."""
        with self._lock:
            return self.copies.kept(session_id) | self._pages.get(session_id, set()), self.copies.gens(session_id)

    def where(self, session_id: str, page_id: str) -> str:
        key = (session_id, page_id)
        with self._lock:
            if key in self._resident or key in self._spilling:
                return "host"
            return "redis" if self.copies.holds(session_id, page_id) else "none"

    def where_many(self, session_id: str, page_ids: list[str]) -> list[str]:
        """``where`` of many pages under one hold of the lock (the memory map asks for every page)."""
        with self._lock:
            return ["host" if (session_id, pid) in self._resident or (session_id, pid) in self._spilling
                    else "redis" if self.copies.holds(session_id, pid) else "none" for pid in page_ids]

    def session_bytes(self, session_id: str) -> int:
        """Host bytes of a session's pages: one lookup of its counter, safe from any thread without the lock."""
        return self.page_bytes * len(self._pages.get(session_id, ()))
