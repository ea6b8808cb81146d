"""The host tier's stores in flight, in the order they began, and the wait of one that finds no page to
spill because every page that could make way is another store's (``wait``).

Only the oldest store waits holding slots; a younger one gives its slots back first, so no two waiting
stores hold what the other needs. A store waiting with no slot (idle) lands nothing until woken, so it
does not count as one that will. Every method runs under the tier's lock, which the condition shares.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable


class StoreOrder:
    def __init__(self, lock: threading.RLock):
        self._tickets = itertools.count()
        self._active: set[int] = set()  # tickets of the stores in flight
        self._idle = 0  # of them, those waiting with no slot
        self._progress = 0  # times slots came free or pages landed
        self._changed = threading.Condition(lock)
        self.waits = 0  # times a store waited (a counter for tests and stats)

    def begin(self) -> int:
        ticket = next(self._tickets)
        self._active.add(ticket)
        return ticket

    def end(self, ticket: int) -> None:
        """A store ended (its pages landed, or it failed)."""
        self._active.discard(ticket)
        self.progressed()

    def oldest(self, ticket: int) -> bool:
        return ticket == min(self._active)

    def others_landing(self, spilling: bool, holding: bool) -> bool:
        """Whether a store (counted among the idle unless ``holding``) may yet see pages land that it
        could spill: a spill in flight, or another store in flight not waiting idle."""
        return spilling or len(self._active) - 1 - (self._idle - (not holding)) > 0

    def wait(self, holding: bool, deadline: float, spilling: Callable[[], bool]) -> bool:
        """Wait until slots come free or pages land (resident pages may then spill), or until nothing in
        flight could land any (the caller then finds itself short); False past ``deadline`` (monotonic)."""
        seen = self._progress
        self.waits += 1
        self._idle += not holding
        self._changed.notify_all()  # one store fewer that will land: those waiting on it look again
        try:
            return self._changed.wait_for(
                lambda: self._progress != seen or not self.others_landing(spilling(), holding),
                deadline - time.monotonic())
        finally:
            self._idle -= not holding

    def progressed(self) -> None:
        """Slots came free or pages landed: the waiting stores look again."""
        self._progress += 1
        self._changed.notify_all()
