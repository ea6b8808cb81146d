"""Which host slot holds which session's page, in least-recently-used order, and which pages are being
spilled to the store (their slots stay theirs until the write ends). Bookkeeping only, no bytes: the
slots' bytes are the pool's (``tiers.host.pool``). No lock of its own: only
``tiers.host.tier.HostTier`` calls it, under the tier's lock.
"""
from __future__ import annotations

from collections import OrderedDict

PageKey = tuple[str, str]  # (session id, page id)


class SlotIndex:
    def __init__(self) -> None:
        self._resident: OrderedDict[PageKey, int] = OrderedDict()  # least recently used first
        self._spilling: dict[PageKey, int] = {}
        self._doomed: set[PageKey] = set()  # spilling pages freed meanwhile: their store copy goes too
        self._pages: dict[str, set[str]] = {}  # per session: its pages in a slot (resident or spilling)

    def slot(self, key: PageKey) -> int | None:
        """The slot holding a page (resident or spilling), or None."""
        return self._resident.get(key, self._spilling.get(key))

    def spilling(self, key: PageKey | None = None) -> bool:
        """Whether this page (any page, without one) is being spilled."""
        return bool(self._spilling) if key is None else key in self._spilling

    def touch(self, key: PageKey) -> None:
        if key in self._resident:
            self._resident.move_to_end(key)

    def land(self, key: PageKey, slot: int) -> int | None:
        """A page written into ``slot``, most recently used; the slot it had before (to free), if any."""
        old = self._resident.pop(key, None)
        self._resident[key] = slot
        self._pages.setdefault(key[0], set()).add(key[1])
        return old

    def pages(self, session_id: str) -> set[str]:
        return self._pages.get(session_id, set())

    def count(self, session_id: str) -> int:
        return len(self._pages.get(session_id, ()))

    def victims(self, k: int, protect: set[PageKey]) -> list[PageKey]:
        """Up to ``k`` least recently used resident pages not in ``protect``, now marked spilling."""
        out = []
        for key in self._resident:
            if len(out) == k:
                break
            if key not in protect:
                out.append(key)
        for key in out:
            self._spilling[key] = self._resident.pop(key)
        return out

    def spilled(self, key: PageKey, written: bool) -> tuple[int | None, bool]:
        """A spill's write of a page ended: (the slot to free, or None when the page stays resident, first
        to go next time; whether its new store copy is of a page freed meanwhile)."""
        slot = self._spilling.pop(key)
        if key[1] not in self._pages.get(key[0], ()):  # freed or dropped while it was written
            doomed = key in self._doomed
            self._doomed.discard(key)
            return slot, doomed and written
        if written:
            self._forget(key)
            return slot, False
        self._resident[key] = slot
        self._resident.move_to_end(key, last=False)
        return None, False

    def free(self, key: PageKey) -> tuple[bool, int | None]:
        """Forget a page: whether it had a slot, and that slot to free now (None while it is being spilled:
        its slot comes back, and its copy goes, when the write ends)."""
        if key[1] not in self._pages.get(key[0], ()):
            return False, None
        slot = self._resident.pop(key, None)
        if slot is None:
            self._doomed.add(key)
        self._forget(key)
        return True, slot

    def drop(self, session_id: str) -> tuple[list[int], int]:
        """Forget every page of a session: the slots to free now, and how many pages it had."""
        mine = self._pages.pop(session_id, set())
        slots = []
        for pid in mine:
            slot = self._resident.pop((session_id, pid), None)
            if slot is None:
                self._doomed.add((session_id, pid))
            else:
                slots.append(slot)
        return slots, len(mine)

    def _forget(self, key: PageKey) -> None:
        mine = self._pages.get(key[0])
        if mine is not None:
            mine.discard(key[1])
            if not mine:
                del self._pages[key[0]]
