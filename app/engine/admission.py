"""Turns waiting for device memory that the turns in flight hold, admitted in arrival order.

A turn whose bound does not fit beside the reservations of the sessions generating now would fit
once some of them end (their reservations drop to what they hold, and idle sessions can be
parked): such a turn waits here, as a serving engine's scheduler queues a request, rather than
being refused. Only the oldest waiting turn tries, so a large turn is not overtaken forever by
small ones; a turn that arrives while others wait queues behind them. A turn that could not fit
even with nothing else in flight, or that waited ``wait_s``, is refused by the caller.

Everything here runs on the event loop: the turns in flight call ``changed`` when they release or
shrink a reservation.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

# Retry at least this often even without a ``changed`` (a reservation released some other way).
POLL_S = 0.5


class AdmissionQueue:
    def __init__(self) -> None:
        self._waiting: deque[object] = deque()
        self._changed: asyncio.Event | None = None  # made while turns wait: an Event belongs to one loop

    def __len__(self) -> int:
        return len(self._waiting)

    async def admit(self, try_admit: Callable[[], bool], may_fit_later: Callable[[], bool], wait_s: float) -> bool:
        """``try_admit()`` reserves the turn and returns True, or returns False when it does not fit
        now. Returns True once it did, False when it did not within ``wait_s`` or ``may_fit_later()``
        says waiting cannot help (nothing else in flight)."""
        if not self._waiting and try_admit():
            return True
        if wait_s <= 0 or not may_fit_later():
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        ticket = object()
        self._waiting.append(ticket)
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = self._changed
        try:
            while True:
                if self._waiting[0] is ticket:
                    if try_admit():
                        return True
                    if not may_fit_later():
                        return False
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), timeout=min(remaining, POLL_S))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._waiting.remove(ticket)
            if self._waiting:
                changed.set()  # the next in line may fit now
            else:
                self._changed = None

    def changed(self) -> None:
        """A reservation was released or shrunk: the oldest waiting turn tries again."""
        if self._changed is not None:
            self._changed.set()
