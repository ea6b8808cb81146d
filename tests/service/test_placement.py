"""Placement on its own (``app.placement``): holders first, then the most room or the hash; a router's
count of what it placed since the last reports; and the room a replica reports of itself."""
from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import pytest

from app.engine.session import Session
from app.placement import RELEASED_KEEP, Candidate, Placer, Room, holds, place, routing_stats
from app.replica_status import ACTIVE_S, replica_room
from rocketkv_mt.config import RocketKVConfig

SESSIONS = [f"s_{i}" for i in range(300)]


def fleet(*rooms: Room | None, held: dict[int, set[str]] | None = None, sid: str = "") -> list[Candidate]:
    held = held or {}
    return [Candidate(f"r{i}", sid in held.get(i, set()), room) for i, room in enumerate(rooms)]


def test_a_holder_wins_whatever_the_policy_and_room():
    rooms = (Room(device_room=100), Room(device_room=10**9), Room(device_room=5))
    for policy in ("memory", "hash"):
        assert place("s_1", fleet(*rooms, held={2: {"s_1"}}, sid="s_1"), policy).key == "r2"


def test_memory_places_a_new_session_on_the_most_device_room():
    rooms = (Room(device_room=100, sessions=1), Room(device_room=900, sessions=50), Room(device_room=500))
    assert {place(s, fleet(*rooms)).key for s in SESSIONS} == {"r1"}


def test_equal_rooms_spread_by_the_hash_and_agree_with_hashing():
    rooms = (Room(device_room=7), Room(device_room=7), Room(device_room=7))
    memory = {s: place(s, fleet(*rooms), "memory").key for s in SESSIONS}
    hashed = {s: place(s, fleet(*rooms), "hash").key for s in SESSIONS}
    assert memory == hashed
    assert set(Counter(memory.values())) == {"r0", "r1", "r2"}


def test_room_ranks_slots_then_device_then_fewer_sessions_then_host():
    full = Room(device_room=10**9, session_slots=0)
    assert place("s_1", fleet(full, Room(device_room=1, session_slots=3))).key == "r1"
    assert place("s_1", fleet(Room(sessions=9), Room(sessions=2))).key == "r1"  # no budget: fewer sessions
    assert place("s_1", fleet(Room(sessions=2, host_free=5), Room(sessions=2, host_free=50))).key == "r1"


def test_hash_ignores_room_and_replicas_without_a_report_wait_for_one():
    rooms = (Room(device_room=0), Room(device_room=10**9))
    assert Counter(place(s, fleet(*rooms), "hash").key for s in SESSIONS).keys() == {"r0", "r1"}
    # One replica has not reported yet: the others take new sessions meanwhile; none reported: the hash.
    assert {place(s, fleet(None, Room(device_room=1))).key for s in SESSIONS} == {"r1"}
    assert Counter(place(s, fleet(None, None)).key for s in SESSIONS).keys() == {"r0", "r1"}
    with pytest.raises(ValueError):
        place("s_1", fleet(None), "nearest")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        place("s_1", [])


def test_a_session_its_replica_reports_released_is_placed_by_room_and_a_held_one_stays():
    """Ray still lists both sessions among the full replica's ids; it reports having let ``s_1`` go
    (parked, its state in Redis): ``s_1``'s next turn goes to the roomier replica, ``s_2`` stays."""
    stats = [routing_stats(Room(device_room=0, sessions=9, reported_at=1.0), ["s_1"]),
             routing_stats(Room(device_room=10**9, sessions=1, reported_at=1.0))]
    ids = [{"s_1", "s_2"}, set()]

    def seen(sid: str) -> list[Candidate]:
        return [Candidate(f"r{i}", holds(sid, ids[i], stats[i]), Room.from_stats(stats[i])) for i in range(2)]

    assert not holds("s_1", ids[0], stats[0]) and holds("s_2", ids[0], stats[0])
    assert place("s_1", seen("s_1")).key == "r1" and Placer().choose("s_1", seen("s_1"), 0.0) == "r1"
    assert place("s_2", seen("s_2")).key == "r0" and Placer().choose("s_2", seen("s_2"), 0.0) == "r0"
    # No report of released sessions (an older replica, or none yet): held means held.
    assert holds("s_1", {"s_1"}, Room().as_stats()) and holds("s_1", {"s_1"}, None)
    assert not holds("s_1", set(), None)


def test_a_replica_reports_only_its_latest_released_sessions():
    released = [f"s_{i}" for i in range(RELEASED_KEEP + 40)]
    stats = routing_stats(Room(device_room=5), released)
    assert stats["released"] == released[-RELEASED_KEEP:] and Room.from_stats(stats) == Room(device_room=5)


def test_room_round_trips_through_routing_stats():
    room = Room(device_room=5, host_free=6, sessions=7, session_slots=8, session_bytes=9, reported_at=1.5)
    assert Room.from_stats(room.as_stats()) == room
    assert Room.from_stats({}) is None and Room.from_stats(None) is None and Room.from_stats({"room": 3}) is None


def test_a_burst_between_two_reports_spreads_by_what_the_router_placed():
    """Twelve new sessions before any replica reports again: each counts against its replica's room, so
    they spread over both instead of all landing on the one that reported a little more room."""
    placer = Placer("memory")
    rooms = (Room(device_room=1000, session_bytes=100, reported_at=1.0),
             Room(device_room=1050, session_bytes=100, reported_at=1.0))
    where = Counter(placer.choose(s, fleet(*rooms), now=0.0) for s in SESSIONS[:12])
    assert where == {"r0": 6, "r1": 6}
    # A new report replaces the count: r0 now reports the room it has left.
    fresh = (Room(device_room=1000, session_bytes=100, reported_at=2.0), rooms[1])
    assert placer.choose("s_new", fleet(*fresh), now=1.0) == "r0"


def test_a_fresh_fleet_counts_sessions_placed_while_none_has_bytes_to_measure():
    placer = Placer("memory")
    rooms = (Room(device_room=10**6, reported_at=1.0), Room(device_room=10**6, reported_at=1.0))
    assert Counter(placer.choose(s, fleet(*rooms), now=0.0) for s in SESSIONS[:10]) == {"r0": 5, "r1": 5}


def test_the_router_remembers_where_it_put_a_session_until_a_replica_lists_it():
    placer = Placer("memory", remember_s=30.0)
    rooms = [Room(device_room=500, session_bytes=400, reported_at=1.0), Room(device_room=400, reported_at=1.0)]
    assert placer.choose("s_a", fleet(*rooms), now=0.0) == "r0"
    # r0 now seems fuller (the session was counted against it), but s_a's next request, sent before r0
    # lists it as held, still goes there; once listed, the holder rule takes over.
    assert placer.choose("s_a", fleet(*rooms), now=5.0) == "r0"
    assert placer.choose("s_a", fleet(*rooms, held={1: {"s_a"}}, sid="s_a"), now=6.0) == "r1"
    # Forgotten after remember_s, or when its replica is gone.
    assert placer.choose("s_b", fleet(*rooms), now=0.0) == "r1"
    assert placer.choose("s_b", fleet(rooms[0]), now=1.0) == "r0"
    with pytest.raises(ValueError):
        Placer("nearest")  # type: ignore[arg-type]


def engine_with(budget: int, *sessions: tuple[Session, int, int]):
    """What ``replica_room`` reads of an engine: sessions, and each one's held and reserved bytes."""
    held = {s.id: h for s, h, _ in sessions}
    reserved = {s.id: r for s, _, r in sessions if r}
    memory = SimpleNamespace(budget=budget, held=held, reserved=reserved)
    tier = SimpleNamespace(free_bytes=lambda: 123)
    return SimpleNamespace(sessions={s.id: s for s, _, _ in sessions}, memory_account=memory,
                           host_memory=SimpleNamespace(tier=tier))


def session(sid: str, idle_s: float, busy: bool = False) -> Session:
    s = Session(id=sid, mode="tiered", rocket=RocketKVConfig(), cache=None)
    s.last_used, s.busy = time.time() - idle_s, busy
    return s


def test_a_replica_counts_turns_in_flight_and_recent_sessions_not_long_idle_ones():
    now = time.time()
    engine = engine_with(
        1000,
        (session("s_busy", 0, busy=True), 100, 250),  # counted at its reservation
        (session("s_recent", 10), 150, 0),
        (session("s_old", ACTIVE_S + 60), 400, 0),  # parked first when room is needed: counted as room
    )
    room = replica_room(engine, max_sessions=5, now=now)
    assert room == Room(device_room=1000 - 250 - 150, host_free=123, sessions=3, session_slots=2,
                        session_bytes=200, reported_at=now)
    unlimited = replica_room(engine_with(0, (session("s_x", 0), 10, 0)), max_sessions=None, now=now)
    assert unlimited.device_room is None and unlimited.session_slots is None
