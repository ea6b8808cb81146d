"""Which replica serves a session: the one that holds it; otherwise (a new session, or one whose replica
is gone) the replica with the most room, or the rendezvous hash of its id alone (``RKV_PLACEMENT``).

Pure and free of Ray: ``api.ray_router`` places real requests with it and ``bench.placement`` replays a
trace through the same code. A replica's room (``Room``) is what it last reported (``app.replica_status
.replica_room``, every few seconds through Ray Serve's routing stats): device bytes not taken by turns in
flight or by sessions active lately, host-tier bytes free, sessions held. Room is ranked in that order, then
ties go to the rendezvous hash, so routers that see the same reports agree and a fresh fleet (all
equal) spreads new sessions as hashing does. A replica that has not reported yet gets no new session
while another has reported.

A report is seconds old when a burst of new sessions arrives; ``Placer`` counts each session it
places against its replica's reported room (its sessions' mean bytes) until that replica reports again,
so the burst spreads instead of landing on one replica.

A replica holds a session when Ray lists it among the replica's multiplexed ids and the replica does not
report it among those it let go lately (``released``): Ray keeps an id after the replica lets the session go
(a session parked off a full device, its state in Redis), and such a session's next turn is placed by room
like a new one's, so that it may move to a replica with room, which restores it without re-prefill.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

Policy = Literal["memory", "hash"]
POLICIES: tuple[str, ...] = ("memory", "hash")
RELEASED_KEEP = 256  # how many of the sessions it let go lately a replica reports


def rendezvous_score(session_id: str, replica_key: str) -> int:
    digest = hashlib.blake2b(f"{session_id}\0{replica_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class Room:
    """A replica's room as it reported it.

    device_room: bytes of its device budget that neither turns in flight nor sessions active within
    ``app.replica_status.ACTIVE_S`` hold (None: no budget, so no limit); the engine parks the longest idle
    sessions first, so theirs count as room. host_free: free bytes of its host tier (None: unknown).
    sessions / session_slots: sessions it holds, and how many more it may (None: no limit).
    session_bytes: its active sessions' mean device bytes, what one more new session is counted as
    until its next report. reported_at: when it measured this (tells a new report from the last one).
    """

    device_room: int | None = None
    host_free: int | None = None
    sessions: int = 0
    session_slots: int | None = None
    session_bytes: int = 0
    reported_at: float = 0.0

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> "Room | None":
        """The room in a replica's routing stats; None when it has not reported one."""
        room = (stats or {}).get("room")
        if not isinstance(room, Mapping):
            return None
        fields = {k: room[k] for k in cls.__dataclass_fields__ if k in room}
        return cls(**fields)

    def as_stats(self) -> dict[str, Any]:
        return {"room": {k: getattr(self, k) for k in self.__dataclass_fields__}}

    def rank(self) -> tuple:
        """Larger is roomier: a free session slot first, then device room, fewer sessions, host room."""
        return (
            self.session_slots is None or self.session_slots > 0,
            math.inf if self.device_room is None else self.device_room,
            -self.sessions,
            math.inf if self.host_free is None else self.host_free,
        )

    def with_placed(self, count: int, session_bytes: int = 0) -> "Room":
        """This room less ``count`` sessions placed since it was reported, each counted as its sessions'
        mean bytes (or ``session_bytes`` while it has none to measure)."""
        if not count:
            return self
        each = self.session_bytes or session_bytes
        return replace(
            self,
            device_room=None if self.device_room is None else self.device_room - count * each,
            sessions=self.sessions + count,
            session_slots=None if self.session_slots is None else self.session_slots - count,
        )


def routing_stats(room: Room, released: Sequence[str] = ()) -> dict[str, Any]:
    """What a replica reports to the routers: its room, and the sessions it let go lately (at most
    ``RELEASED_KEEP``, the latest last)."""
    return {**room.as_stats(), "released": list(released)[-RELEASED_KEEP:]}


def holds(session_id: str, held_ids: Collection[str], stats: Mapping[str, Any] | None) -> bool:
    """Whether a replica holds ``session_id``: among its held (multiplexed) ids and not among the
    sessions its routing stats report released."""
    released = (stats or {}).get("released")
    return session_id in held_ids and not (isinstance(released, (list, tuple)) and session_id in released)


@dataclass(frozen=True)
class Candidate:
    """A live replica as placement sees it: its key, whether it holds the session, its last room."""

    key: str
    holds: bool = False
    room: Room | None = None


def place(session_id: str, candidates: Sequence[Candidate], policy: Policy = "memory") -> Candidate:
    """The replica for ``session_id``: a holder (the hash picks among several); else by ``policy``:
    ``memory``, the most room among those that reported (ties and no reports at all: the hash);
    ``hash``, the rendezvous hash over all."""
    if not candidates:
        raise ValueError("no replica to place a session on")

    def score(c: Candidate) -> int:
        return rendezvous_score(session_id, c.key)

    holders = [c for c in candidates if c.holds]
    if holders:
        return max(holders, key=score)
    if policy == "memory":
        reported = [c for c in candidates if c.room is not None]
        if reported:
            return max(reported, key=lambda c: (c.room.rank(), score(c)))  # type: ignore[union-attr]
    elif policy != "hash":
        raise ValueError(f"unknown placement policy {policy!r}; one of {POLICIES}")
    return max(candidates, key=score)


class Placer:
    """One router's placements: ``place`` with what it placed since the replicas' last reports.

    Remembers, for ``remember_s``, where it put each session it placed, until a replica lists it as held:
    Ray pushes the held ids asynchronously, and a session's second request arriving before that push
    must not be placed again (with room changed, possibly elsewhere). At most ``limit`` sessions.
    """

    def __init__(self, policy: Policy = "memory", remember_s: float = 60.0, limit: int = 10_000):
        if policy not in POLICIES:
            raise ValueError(f"unknown placement policy {policy!r}; one of {POLICIES}")
        self.policy = policy
        self.remember_s = remember_s
        self.limit = limit
        self._placed: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (replica, when)
        self._since: dict[str, tuple[float, int]] = {}  # replica -> (its report's time, sessions placed since)

    def choose(self, session_id: str, candidates: Sequence[Candidate], now: float) -> str:
        """The key of the replica for this request (``now``: the caller's clock, for forgetting)."""
        if any(c.holds for c in candidates):
            self._placed.pop(session_id, None)
            return place(session_id, candidates, self.policy).key
        recent = self._placed.get(session_id)
        keys = {c.key for c in candidates}
        if recent is not None and recent[0] in keys and now - recent[1] < self.remember_s:
            return recent[0]
        typical = max((c.room.session_bytes for c in candidates if c.room is not None), default=0)
        seen = [replace(c, room=self._seen(c, typical)) for c in candidates]
        key = place(session_id, seen, self.policy).key
        self._remember(session_id, key, now, candidates)
        return key

    def _seen(self, c: Candidate, typical: int) -> Room | None:
        """A candidate's room less what was placed on it since that report (``typical``: the bytes of a
        session on a replica that holds none yet)."""
        if c.room is None:
            return None
        at, count = self._since.get(c.key, (c.room.reported_at, 0))
        return c.room.with_placed(count if at == c.room.reported_at else 0, typical)

    def _remember(self, session_id: str, key: str, now: float, candidates: Sequence[Candidate]) -> None:
        room = next(c.room for c in candidates if c.key == key)
        if room is not None:
            at, count = self._since.get(key, (room.reported_at, 0))
            self._since[key] = (room.reported_at, count + 1 if at == room.reported_at else 1)
        self._placed[session_id] = (key, now)
        self._placed.move_to_end(session_id)
        while len(self._placed) > self.limit or (self._placed and now - next(iter(self._placed.values()))[1] > self.remember_s):
            self._placed.popitem(last=False)
        for gone in set(self._since) - {c.key for c in candidates}:
            del self._since[gone]
