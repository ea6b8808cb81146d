"""The host slots turns hold before they run: what admission promised a turn, so that other sessions'
stores leave it alone. A holder is a session's turn in flight (by session id) or what was set aside for a
job of an ended turn (``set_aside``); each holds up to a number of slots of one session. A session's
stores fill what was set aside first (the earlier turn's job runs before the next turn's demotions), then
its turn's. No lock of its own: only ``tiers.host.tier.HostTier`` calls it, under the tier's lock.
"""
from __future__ import annotations


class Reservations:
    def __init__(self) -> None:
        self._held: dict[str, tuple[str, int]] = {}  # holder -> (its session, the slots it may still fill)
        self.refused = 0  # reservations refused: the turns they were for never ran

    def reserve(self, session_id: str, pages: int, free: int) -> bool:
        """Hold up to ``pages`` of ``free`` slots for a session's turn, replacing what its turn held (not
        what was set aside); False (holding nothing) when they are not free beside what others hold."""
        self._held.pop(session_id, None)
        if pages <= 0:
            return True
        if pages > self.free_beside({session_id}, free):
            self.refused += 1
            return False
        self._held[session_id] = (session_id, pages)
        return True

    def clear(self, holder: str) -> None:
        self._held.pop(holder, None)

    def set_aside(self, session_id: str, holder: str) -> None:
        held = self._held.pop(session_id, None)
        if held is not None:
            self._held[holder] = held

    def drop_session(self, session_id: str) -> None:
        for holder in self.holders(session_id):
            del self._held[holder]

    def slots(self) -> int:
        return sum(n for _, n in self._held.values())

    def free_beside(self, own: set[str], free: int) -> int:
        """Of ``free`` slots, those not held by holders other than ``own``."""
        others = sum(n for holder, (_, n) in self._held.items() if holder not in own)
        return max(0, free - others)

    def room(self, session_id: str, free: int) -> int:
        """Free slots a session's store may take: those not held for other sessions' turns."""
        return self.free_beside(set(self.holders(session_id)), free)

    def holders(self, session_id: str) -> list[str]:
        """A session's holders, in the order they began holding."""
        return [holder for holder, (sid, _) in self._held.items() if sid == session_id]

    def filled(self, session_id: str, n: int) -> None:
        """``n`` slots a session's store filled count against what it held: what was set aside first."""
        for holder in self.holders(session_id):
            if holder != session_id:
                n = self._take(holder, n)
        self._take(session_id, n)

    def _take(self, holder: str, n: int) -> int:
        sid, held = self._held.get(holder, ("", 0))
        if held:
            self._held[holder] = (sid, max(0, held - n))
        return max(0, n - held)
