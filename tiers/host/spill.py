"""Making room in the host tier: free slots first, then least recently used pages spilled to the store.

A spill marks its pages as spilling and copies them under the tier's lock, writes them with the lock
released, and frees their slots under it again. When every page that could make way is another store's
(spilling, or not yet landed), a required store waits for one to land (``tiers.host.order``); a
promotion (best effort, on a reader's path) keeps what it has. Owned by ``tiers.host.tier.HostTier``,
whose parts (lock, pool, index, bookkeeping, store) it works on.
"""
from __future__ import annotations

import time

from tiers.base import PageBatch
from tiers.host.index import PageKey

# Spills in a row that free no slot (their writes landed nothing, or the pages went meanwhile) a store may try.
MAKE_ROOM_ROUNDS = 4
# Longest a store waits, in all, for other stores in flight to land their pages so that it can spill
# them: each spill's write is bounded by the store's timeout, so only a fault lasts this long.
LAND_WAIT_S = 30.0


class HostFull(RuntimeError):
    """No host slot for a page: the bound is reached and nothing can spill (no store, or it is failing)."""


class Spiller:
    def __init__(self, tier) -> None:
        self.tier = tier  # the ``HostTier`` whose room this makes
        self.exhausted = 0  # stores refused for want of a slot

    def make_room(self, session_id: str, n: int, protect: set[PageKey], required: bool, ticket: int) -> list[int]:
        """``n`` slots for a session's pages: free ones first, then those of least recently used pages
        spilled (not ``protect``). Short of ``n``: ``HostFull`` when ``required``, else the slots found."""
        got: list[int] = []
        try:
            short = self._fill(session_id, n, protect, required, got, ticket)
        except BaseException:
            with self.tier.lock:
                self.tier.pool.give_back(got)
                self.tier.order.progressed()
            raise
        if short is not None and required:
            with self.tier.lock:
                self.tier.pool.give_back(got)
                self.exhausted += 1
                self.tier.order.progressed()
            raise HostFull(f"the host tier is full ({self.tier.capacity_bytes} bytes) and {short}: "
                           f"{n} more pages of {self.tier.page_bytes} bytes do not fit")
        return got

    def _fill(self, session_id: str, n: int, protect: set[PageKey], required: bool, got: list[int], ticket: int
              ) -> str | None:
        """Add slots to ``got`` up to ``n`` (in place: a failure gives them back); None if it has them, else why not."""
        rounds, deadline = 0, time.monotonic() + LAND_WAIT_S
        spilled_for = 0  # slots in ``got`` that its own spills freed: news to other stores when given back
        while True:
            with self.tier.lock:
                got += self.tier.pool.take(min(n - len(got), self.tier.reservations.room(session_id, self.tier.pool.free_count())))
                if len(got) == n:
                    return None
                if self.tier.store is None:
                    return "there is no store to spill to"
                if not self.tier.can_spill():
                    return f"the store is unavailable ({self.tier.store.last_error})"
                if rounds == MAKE_ROOM_ROUNDS:
                    return "its spills freed no slot"
                victims = self.tier.index.victims(n - len(got), protect)
                if not victims:
                    # Every page that could make way is another store's: a required store waits for one to land.
                    if not required or not self.tier.order.others_landing(self.tier.index.spilling(), holding=True):
                        held = self.tier.pool.free_count() > 0  # free, but held for other sessions' turns
                        return "its free slots are held for other turns" if held else "no page in it can spill"
                    if got and not self.tier.order.oldest(ticket):  # only the oldest waits holding slots
                        self.tier.pool.give_back(got)
                        got.clear()
                        if spilled_for:  # slots taken from the free list were there for the others already
                            self.tier.order.progressed()
                        spilled_for = 0
                    if not self.tier.order.wait(bool(got), deadline, self.tier.index.spilling):
                        return "the stores in flight did not land"
                    continue
                copies = self.tier.pool.copies([self.tier.index.slot(key) for key in victims])
            writes: dict[str, dict[str, PageBatch]] = {}
            for (sid, pid), page in zip(victims, copies):
                writes.setdefault(sid, {})[pid] = page
            written: dict[str, bool] = {}
            try:
                for sid, pages in writes.items():
                    written[sid] = self._write(sid, pages)
            finally:  # a write that raised leaves its pages resident, not spilling for good
                with self.tier.lock:
                    freed, orphans = self._end(victims, written)
                    got += freed
                    spilled_for += len(freed)
                    rounds = 0 if freed else rounds + 1
                    self.tier.order.progressed()
            for sid, pids in orphans.items():
                self.tier.store.delete(sid, pids)
            if not all(written.values()):
                return f"spilling failed ({self.tier.store.last_error})"

    def _write(self, session_id: str, pages: dict[str, PageBatch]) -> bool:
        """With the lock released: write a session's spilled pages, but those the store is believed to hold
        and does (checked: the belief must hold before a slot is let go)."""
        with self.tier.lock:
            believed = self.tier.copies.believed(session_id, list(pages))
        found = self.tier.store.has(session_id, believed)
        if found is None:
            return False
        present = {pid for pid, ok in zip(believed, found) if ok}
        if not self.tier.store.put(session_id, {pid: page for pid, page in pages.items() if pid not in present}):
            return False
        with self.tier.lock:
            self.tier.copies.add(session_id, [pid for pid in pages if pid in self.tier.index.pages(session_id)])
        return True

    def _end(self, victims: list[PageKey], written: dict[str, bool]) -> tuple[list[int], dict[str, list[str]]]:
        """Under the lock, after a spill's writes: the slots they freed, and the store copies of pages freed
        meanwhile (to delete). A page whose write failed stays resident, first to go next time."""
        freed: list[int] = []
        orphans: dict[str, list[str]] = {}
        for key in victims:
            ok = written.get(key[0], False)
            held = key[1] in self.tier.index.pages(key[0])
            slot, doomed = self.tier.index.spilled(key, ok)
            if slot is None:
                continue
            freed.append(slot)
            if doomed:
                orphans.setdefault(key[0], []).extend(self.tier.copies.written_after_free(key[0], [key[1]]))
            elif held:
                self.tier.count_out(1)
                self.tier.stats.spills += 1
        return freed, orphans

