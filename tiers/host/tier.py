"""Host tier: the cold pages of this process in host memory (``tiers.host.pool``), where each one is
(``tiers.host.index``), which have a copy in the store (``tiers.host.copies``; any
``tiers.store.protocol.PageStore``), and the policy that moves them: least recently used pages spill to
the store to make room (``tiers.host.spill``). The pool is a hard bound: with no store, or while it is
unavailable, a store that finds no slot fails with ``HostFull``, storing nothing; admission keeps that
from happening mid-turn (``reserve``, ``tiers.host.reservations``).

One lock guards the index, the bookkeeping and the pool, and no store call is made under it (reads,
spills, persists and frees talk to the store between two holds): the page reader may demote one
session's pages while the model thread reads another's, and a store that does not answer stalls only its caller.
"""
from __future__ import annotations

import threading

import torch

from tiers.base import PageBatch, TierStats
from tiers.host.copies import StoreCopies
from tiers.host.index import PageKey, SlotIndex
from tiers.host.order import StoreOrder
from tiers.host.pool import HostPool
from tiers.host.reservations import Reservations
from tiers.host.spill import HostFull, Spiller
from tiers.store.protocol import PageStore


class ChunkUnavailable(KeyError):
    """A cold page is neither in host memory nor readable from the store (not there, or it is down)."""


class HostTier:
    def __init__(self, capacity_bytes: int, store: PageStore | None = None, pin: bool | None = None,
                 page_bytes: int | None = None):
        self.capacity_bytes, self.store = capacity_bytes, store
        self.pool = HostPool(capacity_bytes, torch.cuda.is_available() if pin is None else pin, page_bytes)
        self.stats = TierStats()
        self.index = SlotIndex()
        self.copies = StoreCopies()
        self.reservations = Reservations()
        self.lock = threading.RLock()
        # Stores between taking slots and landing their pages: the pages that will make way for another store.
        self.order = StoreOrder(self.lock)
        self.spiller = Spiller(self)

    exhausted = property(lambda self: self.spiller.exhausted)  # stores refused for want of a slot
    waits = property(lambda self: self.order.waits)  # stores that waited for others to land pages to spill
    refused = property(lambda self: self.reservations.refused)  # reservations refused
    max_slots = property(lambda self: self.pool.max_slots)
    page_bytes = property(lambda self: self.pool.page_bytes)

    def can_spill(self) -> bool:
        return self.store is not None and not self.store.unavailable()

    # --- admission ---------------------------------------------------------------------------
    def reserve(self, session_id: str, pages: int) -> bool:
        """Hold free slots for up to ``pages`` pages a session's turn may demote (``Reservations.reserve``).
        While pages can spill nothing needs holding: any resident page can make way."""
        with self.lock:
            if self.can_spill():
                self.reservations.clear(session_id)
                return True
            return self.reservations.reserve(session_id, pages, self.pool.free_count())

    def set_aside(self, session_id: str, holder: str) -> None:
        """The slots a session's turn holds stay held under ``holder`` (for a job of that turn still to
        run), apart from the session's next turn, until ``release(holder)``."""
        with self.lock:
            self.reservations.set_aside(session_id, holder)

    def release(self, holder: str) -> None:
        """A turn (a session id), or what was set aside for a job of it, ended: its unfilled slots are free."""
        with self.lock:
            self.reservations.clear(holder)
            self.order.progressed()

    def reserved_bytes(self) -> int:
        with self.lock:
            return self.reservations.slots() * self.page_bytes

    def free_bytes(self) -> int:
        """Bytes of the free slots (those held for turns in flight included)."""
        with self.lock:
            return self.pool.free_count() * self.page_bytes

    def count_out(self, n: int) -> None:
        self.stats.entries -= n
        self.stats.bytes -= n * self.page_bytes

    # --- pages -------------------------------------------------------------------------------
    def put_many(self, session_id: str, page_ids: list[str], batch: PageBatch) -> int:
        """Store pages demoted from the device (copied into slots); returns the bytes written. All or
        nothing: ``HostFull`` when they do not fit and cannot spill (none of them is then stored)."""
        if not page_ids:
            return 0
        with self.lock:
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
        with self.lock:
            self.stats.demotions += len(page_ids)
            self.stats.bytes_written += nbytes
        return nbytes

    @torch.inference_mode()
    def _store(self, session_id: str, page_ids: list[str], batch: PageBatch, required: bool) -> int:
        """Copy pages into slots (made room for); without ``required`` only the first ones that fit.
        Inference mode: pool rows written during a model step are inference tensors, writable only there."""
        keys = [(session_id, pid) for pid in page_ids]
        with self.lock:
            ticket = self.order.begin()
        try:
            slots = self.spiller.make_room(session_id, len(keys), set(keys), required, ticket)
            return self._land(session_id, keys, batch, slots, promoted=not required)
        finally:
            with self.lock:
                self.order.end(ticket)

    def _land(self, session_id: str, keys: list[PageKey], batch: PageBatch, slots: list[int], promoted: bool) -> int:
        """Write the first ``len(slots)`` pages into the slots made for them. A page already spilling
        (another reader promoted it too) is skipped, and so is a ``promoted`` page (read back from the
        store) that was freed while it was read: it must not come back."""
        if not slots:
            return 0
        n = len(slots)
        with self.lock:
            try:
                self.pool.write(slots, {k: t[:n] for k, t in batch.items()})
            except BaseException:
                self.pool.give_back(slots)
                raise
            landed = 0
            for key, slot in zip(keys, slots):
                if self.index.spilling(key) or (promoted and not self.copies.holds(*key)):
                    self.pool.give_back([slot])
                    continue
                old = self.index.land(key, slot)
                if old is not None:  # the same page written again: its old slot is free
                    self.pool.give_back([old])
                    self.count_out(1)
                landed += 1
            self.reservations.filled(session_id, landed)
            self.stats.entries += landed
            self.stats.bytes += landed * self.page_bytes
        return n

    @torch.inference_mode()
    def read_many(self, session_id: str, page_ids: list[str]) -> tuple[PageBatch, int]:
        """Copies of the pages, in order, and the bytes of them that came from the store. Spilled pages come
        back in one round trip (with the lock released) and are stored in the pool again where there is
        room (a promotion); ``ChunkUnavailable`` when a page can be read nowhere."""
        keys = [(session_id, pid) for pid in page_ids]
        out: PageBatch | None = None
        with self.lock:
            slots = [self.index.slot(key) for key in keys]
            misses = [i for i, slot in enumerate(slots) if slot is None]
            if misses and (self.store is None or any(not self.copies.holds(*keys[i]) for i in misses)):
                raise ChunkUnavailable(f"page {keys[misses[0]]} is in no tier that can be read now")
            hits = [(i, slot) for i, slot in enumerate(slots) if slot is not None]
            if hits:
                out = self.pool.empty(len(keys))
                self.pool.gather([s for _, s in hits], out, [i for i, _ in hits] if misses else None)
                for i, _ in hits:
                    self.index.touch(keys[i])
                self.stats.hits += len(hits)
        if misses:
            fetched = self.store.get(session_id, [keys[i][1] for i in misses])
            if any(page is None for page in fetched):
                raise ChunkUnavailable(f"a page of session {session_id} is in no tier that can be read now")
            if out is None:
                with self.lock:
                    self.pool.lay_out({k: t.unsqueeze(0) for k, t in fetched[0].items()})
                    out = self.pool.empty(len(keys))
            at = torch.tensor(misses, dtype=torch.long)
            for name in out:
                out[name].index_copy_(0, at, torch.stack([page[name] for page in fetched]))
            with self.lock:
                self.stats.misses += len(misses)
                self.stats.promotions += len(misses)
                kept = [i for i in misses if self.copies.holds(*keys[i])]  # not those freed while read
            if kept:  # best effort: a page that finds no room stays in the store only
                at = torch.tensor(kept, dtype=torch.long)
                self._store(session_id, [keys[i][1] for i in kept], {n: t.index_select(0, at) for n, t in out.items()},
                            required=False)
        with self.lock:
            self.stats.bytes_read += len(keys) * self.page_bytes
        return out, len(misses) * self.page_bytes

    def free_many(self, session_id: str, page_ids: list[str]) -> None:
        """Forget pages everywhere: their host slots, and their store copies no committed record names."""
        with self.lock:
            for pid in page_ids:
                held, slot = self.index.free((session_id, pid))
                if slot is not None:
                    self.pool.give_back([slot])
                self.count_out(held)
            self.order.progressed()
            gone = self.copies.free(session_id, page_ids)
        if gone and self.store is not None:
            self.store.delete(session_id, gone)

    def _drop(self, session_id: str, deleted: bool) -> list[str]:
        """Give back a session's slots and forget its bookkeeping: the groups to delete (no record names them)."""
        with self.lock:
            slots, n = self.index.drop(session_id)
            self.pool.give_back(slots)
            self.count_out(n)
            self.reservations.drop_session(session_id)
            self.order.progressed()
            return self.copies.leave(session_id, deleted)

    def drop_session(self, session_id: str, deleted: bool = False) -> None:
        """A session leaves this process (its record keeps it, or it was ``deleted``): its slots, and what
        no record names of it."""
        gone = self._drop(session_id, deleted)
        if self.store is not None:
            self.store.delete(session_id, gone)
            self.store.forget(session_id)

    def unstored(self, session_id: str, page_ids: list[str]) -> dict[str, PageBatch] | None:
        """Copies of the pages the store lacks, to write (after a ``distrust``, each belief is checked
        first); None when the store cannot be asked or a page is held nowhere."""
        with self.lock:
            check = self.copies.believed(session_id, page_ids) if self.copies.distrusted(session_id) else []
        found = self.store.has(session_id, check) if self.store is not None else None
        if found is None:
            return None
        with self.lock:
            self.copies.lost(session_id, [pid for pid, ok in zip(check, found) if not ok])
            missing = [pid for pid in page_ids if not self.copies.holds(session_id, pid)]
            slots = [self.index.slot((session_id, pid)) for pid in missing]
            if any(slot is None for slot in slots):
                return None
            return dict(zip(missing, self.pool.copies(slots)))

    def stored(self, session_id: str, page_ids) -> None:
        """The store took these pages (a persist wrote them): believed held from now on."""
        with self.lock:
            mine = self.index.pages(session_id)
            self.copies.add(session_id, [pid for pid in page_ids if pid in mine])
            self.copies.distrust(session_id, False)

    # --- what the store holds ----------------------------------------------------------------
    def locked(self, call, *args):
        """``call(*args)`` under the lock: a ``StoreCopies`` method (from ``tiers.session_kv`` or the engine)."""
        with self.lock:
            return call(*args)

    def renew_pending(self) -> int:
        """Give every session's pending groups the short TTL again; returns how many were renewed."""
        with self.lock:
            pending = {sid: self.copies.pending(sid) for sid in self.copies.holding()}
        done = 0
        for sid, groups in pending.items():
            if groups and self.store is not None and self.store.renew(sid, groups):
                done += len(groups)
        return done

    def where_many(self, session_id: str, page_ids: list[str]) -> list[str]:
        """Where each page is ("host", "redis" for the store, or "none"), under one hold of the lock."""
        with self.lock:
            return ["host" if self.index.slot((session_id, pid)) is not None
                    else "redis" if self.copies.holds(session_id, pid) else "none" for pid in page_ids]

    def session_bytes(self, session_id: str) -> int:
        """Host bytes of a session's pages: one lookup, safe from any thread without the lock."""
        return self.page_bytes * self.index.count(session_id)
