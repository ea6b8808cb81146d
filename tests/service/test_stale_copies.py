"""A replica holding a copy of a session that another replica moved on from lets go of it while Redis
can tell, and a turn that ran on such a copy (the race the per-request check cannot close) is not
acknowledged: it answers ``session_moved`` and, sent again, runs once on the current state. Real
model, real (private) Redis."""
from __future__ import annotations

import asyncio
import secrets

from replica_helpers import events_of, replica

from app.contract.events import Done, TurnFailed
from app.contract.ids import new_session_id
from app.session_fence import DIVERGED, MINE, MOVED_ON


async def moved_on(a, b) -> tuple[str, str]:
    """A session made and taken a turn in on ``a``, then a turn on ``b``, which moves it on."""
    sid = new_session_id()
    token = (await a.create_session(sid, mode="tiered"))["token"]
    assert isinstance((await events_of(a, sid, token, "Hello there."))[-1], Done)
    assert isinstance((await events_of(b, sid, token, "And again."))[-1], Done)
    return sid, token


async def test_housekeeping_lets_go_of_a_copy_another_replica_moved_on_from(make_engine, private_redis):
    ns = f"rkvstale-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name) for name in ("a", "b"))
    try:
        sid, token = await moved_on(a, b)
        await a._drop_stale()
        assert sid not in a.engine.sessions and sid in b.engine.sessions
        await b._drop_stale()  # the holder of the latest record keeps it
        assert sid in b.engine.sessions
    finally:
        await a.close()
        await b.close()


async def test_a_turn_on_a_copy_that_moved_on_meanwhile_is_not_acknowledged(make_engine, private_redis, monkeypatch):
    ns = f"rkvstale-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name) for name in ("a", "b"))
    try:
        async def not_yet(*args):  # b's save lands after a's check: the race a check cannot close
            return MINE

        with monkeypatch.context() as m:
            # a's housekeeping (every second) would let go of the stale copy on a slow machine, and the
            # turn would then rightly restore the current state: hold it off for the race's window
            m.setattr(a, "_drop_stale", not_yet)
            sid, token = await moved_on(a, b)
            assert sid in a.engine.sessions  # a still holds the copy b moved on from
            m.setattr(a.repository, "check", not_yet)
            failed = (await events_of(a, sid, token, "A third.", key="k3"))[-1]
        assert isinstance(failed, TurnFailed) and failed.code == "session_moved"
        done = (await events_of(a, sid, token, "A third.", key="k3"))[-1]  # sent again: restored, runs
        assert isinstance(done, Done)
        users = [m["content"] for m in (await b.get_session(sid, token))["messages"] if m["role"] == "user"]
        assert users == ["Hello there.", "And again.", "A third."]  # once, after b's turn
    finally:
        await a.close()
        await b.close()


async def test_a_save_in_flight_is_not_taken_for_another_replica_moving_on(make_engine, private_redis):
    """Between a save's compare-and-set and its bookkeeping, Redis already holds the new tag: neither
    housekeeping nor a request may take this replica's own save for another's."""
    ns = f"rkvstale-{secrets.token_hex(3)}"
    a = replica(make_engine, private_redis.url, ns, "a")
    try:
        sid = new_session_id()
        token = (await a.create_session(sid, mode="tiered"))["token"]
        committed, go = asyncio.Event(), asyncio.Event()
        settled = a.engine.kv_settled

        async def slow_settle(*args, **kwargs):
            committed.set()
            await go.wait()
            return await settled(*args, **kwargs)

        a.engine.kv_settled = slow_settle
        turn = asyncio.create_task(events_of(a, sid, token, "Hello there."))
        await asyncio.wait_for(committed.wait(), 60)
        assert await a.repository.refresh() == ([], [])
        checking = asyncio.create_task(a.repository.check(sid))
        await asyncio.sleep(0.1)
        go.set()
        assert isinstance((await turn)[-1], Done) and await checking not in (MOVED_ON, DIVERGED)
        assert await a.repository.check(sid) == MINE and sid not in a.repository.stale
        await a._drop_stale()
        assert sid in a.engine.sessions
    finally:
        await a.close()
