"""The service's session jobs on their own, without a model: owner-and-token checks, and which
sessions leave memory (idle ones, least recently used first, only when they can come back)."""
from __future__ import annotations

import time

import pytest

from app.contract.errors import SessionNotFound, TooManySessions
from app.engine.session import Session
from app.session_access import SessionAccess, token_digest
from app.session_residency import Residency
from rocketkv_mt.config import RocketKVConfig


def session(sid: str, owner: str | None = None, idle_s: float = 0.0, busy: bool = False) -> Session:
    s = Session(id=sid, mode="full", rocket=RocketKVConfig(), cache=None, owner=owner)
    s.last_used = time.time() - idle_s
    s.busy = busy
    return s


class HeldSessions:
    """What ``Residency`` reads of an engine: the sessions held; ``drop`` is what leaving costs."""

    def __init__(self, *sessions: Session):
        self.sessions = {s.id: s for s in sessions}
        self.dropped: list[str] = []

    def drop(self, sid: str) -> None:
        self.sessions.pop(sid)
        self.dropped.append(sid)


def test_only_the_owner_with_the_token_opens_a_session():
    access = SessionAccess()
    mine = session("s_mine", owner="key-a")
    token = access.issue(mine.id)
    access.check(mine, token, "key-a")
    for bad_token, owner in ((token, "key-b"), ("wrong", "key-a"), (None, "key-a"), (token, None)):
        with pytest.raises(SessionNotFound):
            access.check(mine, bad_token, owner)
    with pytest.raises(SessionNotFound):
        access.check_id("s_x:meta")  # not an id: never reaches a lookup
    record = {"owner": "key-a", "token_sha256": token_digest(token)}
    access.check_record(mine.id, record, token, "key-a")
    with pytest.raises(SessionNotFound):
        access.check_record(mine.id, record, token, "key-b")
    with pytest.raises(SessionNotFound):
        access.check_record(mine.id, None, token, "key-a")


def test_idle_sessions_leave_only_when_they_can_come_back():
    engine = HeldSessions(
        session("s_old", idle_s=100), session("s_unsaved", idle_s=100), session("s_busy", idle_s=100, busy=True),
        session("s_fresh"),
    )
    residency = Residency(engine, can_leave=lambda s: not s.busy and s.id != "s_unsaved", leave=engine.drop,
                          idle_evict_s=10)
    residency.evict_idle()
    assert engine.dropped == ["s_old"]


def test_a_full_replica_makes_room_least_recently_used_first_or_refuses():
    engine = HeldSessions(session("s_a", idle_s=30), session("s_b", idle_s=20), session("s_c", idle_s=10))
    residency = Residency(engine, can_leave=lambda s: s.id != "s_b", leave=engine.drop, max_sessions=3)
    residency.admit()  # s_a leaves: the least recently used that can
    assert engine.dropped == ["s_a"]
    engine.sessions["s_d"] = session("s_d")
    assert residency.make_room(keep="s_c") is True  # s_b cannot leave and s_c is kept: s_d goes
    assert engine.dropped == ["s_a", "s_d"]
    engine.sessions["s_e"] = session("s_e")
    assert Residency(engine, can_leave=lambda s: s.id == "s_e", leave=engine.drop, max_sessions=3).make_room(
        keep="s_e") is False
    with pytest.raises(TooManySessions):
        Residency(engine, can_leave=lambda s: False, leave=engine.drop, max_sessions=3).admit()
