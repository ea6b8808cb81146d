"""A save that a turn overtakes: housekeeping saves a session (its KV first, then its record) while a
client's next turn begins on it. The record must never hold that turn half-way (its message without its
reply): a replica killed then would leave a history no client can continue. The save steps back, the
KV it wrote goes, and the turn's own save commits the whole turn. Real model, real Redis."""
from __future__ import annotations

import asyncio
import secrets

import pytest
import redis
from replica_helpers import new_session, replica, turn

from app.session_repository import DEFERRED
from app.session_store import KV_MISSING, SaveResult
from bench.soak_checks import missing_groups

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("when", ["redis_asked", "kv_written", "kv_written_again"])
async def test_a_turn_that_begins_while_a_save_writes_kv_is_never_committed_half_way(make_engine, redis_url,
                                                                                    monkeypatch, when):
    """``redis_asked``: the turn begins while the save asks Redis how an earlier commit whose reply was lost
    ended, before any KV is written. ``kv_written_again``: the store first answers that a group the record
    names is gone, so the save writes its KV again, and the turn begins during that second write."""
    ns = f"rkvsnap-{secrets.token_hex(3)}"
    service = replica(make_engine, redis_url, ns, "a")
    try:
        sid, token = await new_session(service)
        session = service.engine.sessions[sid]
        before = [m["content"] for m in session.messages]
        repo, persist, commit = service.repository, service.engine.persist, service.repository.store.save
        began: list[asyncio.Task] = []
        writes = 0

        async def a_turn_begins():
            began.append(asyncio.create_task(turn(service, sid, token, "Name a colour.")))
            async with asyncio.timeout(30):
                while len(session.messages) == len(before):  # the turn has taken its message
                    await asyncio.sleep(0.001)

        async def resolved_while_a_turn_begins(s):
            if not began:
                await a_turn_begins()
            return True

        async def persist_while_a_turn_begins(s):
            nonlocal writes
            writes += 1
            kv = await persist(s)
            if not began and (when == "kv_written" or writes == 2):
                await a_turn_begins()
            return kv

        async def commit_finding_kv_gone_once(*args):
            if when == "kv_written_again" and writes == 1:
                return SaveResult(KV_MISSING, missing="g0")
            return await commit(*args)

        monkeypatch.setattr(service.engine, "persist", persist_while_a_turn_begins)
        monkeypatch.setattr(repo.store, "save", commit_finding_kv_gone_once)
        if when == "redis_asked":
            monkeypatch.setattr(repo, "_resolved", resolved_while_a_turn_begins)
        outcome, saved = await repo.save(session, service.access.digest(sid))
        data, _ = await repo.store.load(sid)
        assert [m["content"] for m in data["messages"]] == before  # the record before the turn, untouched
        assert outcome == DEFERRED and not saved.saved
        assert writes == {"redis_asked": 0, "kv_written": 1, "kv_written_again": 2}[when]
        assert repo.unsaved == 1  # saved again by housekeeping if the turn that overtook it is undone

        done = await began[0]  # the turn's own save commits it whole
        assert done.storage.saved and repo.unsaved == 0
        data, _ = await repo.store.load(sid)
        assert data["messages"] == session.messages and data["messages"][-1]["role"] == "assistant"
        assert data["token_ids"] == session.token_ids
        assert missing_groups(redis.Redis.from_url(redis_url), ns) == []
    finally:
        await service.close()
