"""Which sessions stay in a replica's memory: at most ``max_sessions``, none idle for longer than
``idle_evict_s``.

Only a session that can come back may leave: idle, and with its latest state in Redis (the
repository says so). Leaving is the engine's ``drop``, which frees the session's device memory
and host-tier pages and keeps its Redis copies for the next request, here or on another replica.
At the cap, the least recently used sessions that can leave make room; when none can, a new
session is refused with ``too_many_sessions``. A session parked off a full device that can come back
leaves too (``let_parked_go``), so that the router may place its next turn where there is room.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from app.contract.errors import TooManySessions
from app.engine.engine import Engine
from app.engine.session import Session


class Residency:
    def __init__(
        self,
        engine: Engine,
        can_leave: Callable[[Session], bool],
        leave: Callable[[str], None],
        max_sessions: int | None = None,
        idle_evict_s: float = 3600.0,
    ):
        self.engine = engine
        self.can_leave = can_leave  # idle and stored: dropping it from memory loses nothing
        self.leave = leave  # forgets it everywhere in this process (engine, tokens, versions)
        self.max_sessions = max_sessions
        self.idle_evict_s = idle_evict_s

    def evict_idle(self) -> None:
        """Let go of the sessions idle for longer than ``idle_evict_s`` that can come back."""
        cutoff = time.time() - self.idle_evict_s
        for sid, session in list(self.engine.sessions.items()):
            if session.last_used < cutoff and self.can_leave(session):
                self.leave(sid)

    def let_parked_go(self) -> list[str]:
        """Let go of the sessions the engine parked to make room on its full device that can come back,
        and name them: another replica with room may take their next turn (``app.placement``), restoring
        them from Redis as this one would have."""
        gone = [sid for sid, s in list(self.engine.sessions.items()) if s.parked and self.can_leave(s)]
        for sid in gone:
            self.leave(sid)
        return gone

    def make_room(self, keep: str | None = None) -> bool:
        """Bring the sessions held under ``max_sessions`` by letting the least recently used ones
        that can come back go (never ``keep``); False when that is not enough."""
        if self.max_sessions is None:
            return True
        held = self.engine.sessions
        if len(held) < self.max_sessions:
            return True
        for sid, session in sorted(held.items(), key=lambda item: item[1].last_used):
            if sid != keep and self.can_leave(session):
                self.leave(sid)
                if len(held) < self.max_sessions:
                    return True
        return False

    def admit(self) -> None:
        """Room for one more session, or ``too_many_sessions``."""
        if not self.make_room():
            raise TooManySessions(
                f"this replica holds its limit of {self.max_sessions} sessions; delete one or try again later"
            )
