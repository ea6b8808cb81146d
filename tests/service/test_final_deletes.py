"""A delete is final: a save in flight cannot bring the session back, a job of its cache on the model
thread cannot leak host slots or leave keys behind, a replica that holds a copy of a session deleted
elsewhere never serves it again, and the tombstone deletes the KV its record named in the same step, so
a replica that dies right after it leaves nothing behind that outlives the pending TTL. Real model,
real (private) Redis."""
from __future__ import annotations

import asyncio
import secrets
import time

import pytest
from replica_helpers import LONG, new_session, replica, turn
from serving_helpers import RedisServer

from app.chat_service import ChatService
from app.contract.errors import SessionNotFound
from tiers.store.redis.keys import kv_key, session_key, session_pattern

PENDING_S = 10  # the shortest pending TTL the settings allow


def keys_left(server: RedisServer, ns: str) -> set[str]:
    return {k.decode() for k in server.client().scan_iter(match=session_pattern(ns), count=1000)}


def assert_deleted(service: ChatService, server: RedisServer, ns: str, sid: str) -> None:
    """Only the tombstone is left of the session: no KV key, no host slot, not in the engine."""
    assert keys_left(server, ns) == {session_key(ns, sid)}
    assert server.client().hget(session_key(ns, sid), "deleted") == b"1"
    host = service.engine.host_tier
    assert host.session_bytes(sid) == 0 and host.pool.free_count() == host.max_slots - host.stats.entries
    assert sid not in service.engine.sessions


async def test_a_save_in_flight_when_the_session_is_deleted_does_not_bring_it_back(make_engine, private_redis):
    ns = f"rkvdel-{secrets.token_hex(3)}"
    service = replica(make_engine, private_redis.url, ns, "a")
    try:
        sid, token = await new_session(service)
        session = service.engine.sessions[sid]
        store, original = service.store, service.store.save
        held, go = asyncio.Event(), asyncio.Event()

        async def held_save(*args):
            held.set()
            await go.wait()  # the KV was written; the record's compare-and-set waits here
            return await original(*args)

        store.save = held_save
        saving = asyncio.create_task(service.repository.save(session, service.access.digest(sid)))
        await asyncio.wait_for(held.wait(), 30)
        await service.delete_session(sid, token)
        go.set()
        await saving
        assert (await store.stored(sid)).deleted and await store.load(sid) is None
        assert_deleted(service, private_redis, ns, sid)
        with pytest.raises(SessionNotFound):
            await service.resume_session(sid, token)
    finally:
        await service.close()


async def test_a_delete_waits_for_the_jobs_of_its_cache_on_the_model_thread(make_engine, private_redis):
    ns = f"rkvdel-{secrets.token_hex(3)}"
    service = replica(make_engine, private_redis.url, ns, "a")
    try:
        sid, token = await new_session(service)
        cache = service.engine.sessions[sid].cache

        def late_persist():  # a persist (or park) job already queued when the delete comes
            time.sleep(0.3)
            return cache.persist()

        job = service.engine.batcher.submit(late_persist)
        await service.delete_session(sid, token)
        assert job.done() and job.result() is not None  # it ran first, and wrote to Redis
        assert_deleted(service, private_redis, ns, sid)
    finally:
        await service.close()


async def test_a_copy_of_a_session_deleted_elsewhere_never_serves_again(make_engine, private_redis):
    ns = f"rkvdel-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name) for name in ("a", "b"))
    try:
        sid, token = await new_session(a)
        await b.delete_session(sid, token)  # b restores it from its record, then deletes it
        with pytest.raises(SessionNotFound):
            await a.get_session(sid, token)
        failed = [e async for e in a.chat(sid, token, "Still there?", {"max_tokens": 4})]
        assert getattr(failed[-1], "code", None) == "session_not_found"
        for service in (a, b):
            assert_deleted(service, private_redis, ns, sid)
    finally:
        await a.close()
        await b.close()


async def test_a_delete_whose_replica_dies_after_the_tombstone_leaves_nothing_that_outlives_the_pending_ttl(
        make_engine, private_redis, monkeypatch):
    """The tombstone and the deletion of the KV its record named are one step: a replica killed right after
    it (before its own cleanup) leaves the tombstone, and of its KV only what no record named, which
    expires within the pending TTL; every replica then takes the session for deleted."""
    ns = f"rkvdel-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name, redis_pending_ttl_s=PENDING_S) for name in ("a", "b"))
    try:
        sid, token = await new_session(a)
        client = private_redis.client()
        named = client.hget(session_key(ns, sid), "groups").decode().split()
        assert named and all(client.exists(kv_key(ns, sid, g)) for g in named)

        async def lost(*args):  # the next turn's record never lands: its KV is written, named by no record
            raise ConnectionError("cut off")

        monkeypatch.setattr(a.store, "save", lost)
        assert not (await turn(a, sid, token, LONG + " Which ships passed by?")).storage.saved
        unnamed = keys_left(private_redis, ns) - {session_key(ns, sid), *(kv_key(ns, sid, g) for g in named)}
        assert unnamed

        async def dies_after_the_tombstone(session_id):  # a kill -9 between the tombstone and the local cleanup
            raise asyncio.CancelledError

        monkeypatch.setattr(a.engine, "purge", dies_after_the_tombstone)
        with pytest.raises(asyncio.CancelledError):
            await a.delete_session(sid, token)
        a._housekeeper.cancel()  # dead: nothing of a renews what it wrote
        a.engine.renewal.close()
        assert client.hget(session_key(ns, sid), "deleted") == b"1"
        left = keys_left(private_redis, ns) - {session_key(ns, sid)}
        assert left and left <= unnamed  # what the record named is gone (a's housekeeping may have taken more)
        assert all(0 < client.ttl(k) <= PENDING_S for k in left)
        with pytest.raises(SessionNotFound):
            await b.resume_session(sid, token)
    finally:
        await a.close()
        await b.close()
