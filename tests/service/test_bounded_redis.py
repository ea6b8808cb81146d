"""Redis as a bounded resource: an evicting Redis is refused at start; a Redis at ``maxmemory`` under
``noeviction`` gives turns that go on unsaved (and say so) or a structured refusal, as configured, never
a half-written record; quotas per owner count what Redis keeps. Real model, private Redis."""
from __future__ import annotations

import secrets

import pytest
from replica_helpers import LONG, events_of, new_session, replica, turn

from app.chat_service import StoragePolicy
from app.contract.errors import QuotaExceeded
from app.contract.events import Done, TurnFailed
from app.contract.ids import new_session_id
from tiers.store.redis.config import EvictingRedis


def test_an_evicting_redis_is_refused_at_start_unless_allowed(make_engine, private_redis):
    private_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(EvictingRedis, match="maxmemory-policy allkeys-lru"):
        make_engine(redis_url=private_redis.url)
    engine = make_engine(redis_url=private_redis.url, redis_allow_eviction=True)
    assert engine.store_config.evicting and engine.store_config.fsync == "always"


def test_a_redis_without_config_is_judged_by_what_info_says(make_engine, tmp_path):
    """Managed Redis renames CONFIG away: its policy is read from INFO, and an evicting one still refused."""
    from serving_helpers import RedisServer

    with RedisServer(tmp_path, extra=("--rename-command", "CONFIG", "", "--maxmemory-policy", "allkeys-lru")) as r:
        with pytest.raises(EvictingRedis, match="maxmemory-policy allkeys-lru"):
            make_engine(redis_url=r.url)
        engine = make_engine(redis_url=r.url, redis_allow_eviction=True)
        assert engine.store_config.policy == "allkeys-lru" and engine.store_config.fsync == "unknown"


def full(server) -> None:
    """Redis at its bound: every write refused (noeviction), reads still answered."""
    client = server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", max(1, int(client.info("memory")["used_memory"]) // 2))


def roomy(server) -> None:
    server.client().config_set("maxmemory", 0)


async def test_a_full_redis_leaves_the_record_whole_and_the_turn_unsaved_then_saved(make_engine, private_redis):
    ns = f"rkvfull-{secrets.token_hex(3)}"
    a = replica(make_engine, private_redis.url, ns, "a")
    try:
        sid, token = await new_session(a)
        before, stored = await a.store.load(sid)
        full(private_redis)
        done = await turn(a, sid, token, "What did the keeper write about?")
        assert not done.storage.saved and done.storage.durability == "none"
        after, still = await a.store.load(sid)
        assert still.tag == stored.tag and after["messages"] == before["messages"]  # nothing half-written
        roomy(private_redis)
        await a.repository.save_unsaved(a.access.digest)
        saved, _ = await a.store.load(sid)
        assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == [
            LONG, "What did the keeper write about?"]
        assert saved["kv"] is not None
    finally:
        await a.close()


async def test_a_full_redis_refuses_turns_where_the_operator_says_so(make_engine, private_redis):
    a = replica(make_engine, private_redis.url, f"rkvfull-{secrets.token_hex(3)}", "a", StoragePolicy(refuse_unsaved=True))
    try:
        sid, token = await new_session(a)
        full(private_redis)
        failed = (await events_of(a, sid, token, "What did the keeper write about?"))[-1]
        assert isinstance(failed, TurnFailed) and failed.code == "store_unavailable"
        roomy(private_redis)
        again = (await events_of(a, sid, token, "And the gulls?"))[-1]  # the refused turn was taken back
        assert isinstance(again, Done) and again.storage.saved
        users = [m["content"] for m in (await a.get_session(sid, token))["messages"] if m["role"] == "user"]
        assert users == [LONG, "And the gulls?"]
    finally:
        await a.close()


async def test_quotas_count_what_an_owner_keeps_in_redis(make_engine, private_redis):
    a = replica(make_engine, private_redis.url, f"rkvquota-{secrets.token_hex(3)}", "a",
                StoragePolicy(quota_sessions=1, quota_bytes=4096))
    try:
        first = new_session_id()
        token = (await a.create_session(first, mode="tiered", owner="o1"))["token"]
        with pytest.raises(QuotaExceeded):
            await a.create_session(new_session_id(), mode="tiered", owner="o1")
        await a.create_session(new_session_id(), mode="tiered", owner="o2")  # another key's quota
        events = [e async for e in a.chat(first, token, LONG, {"max_tokens": 4}, owner="o1")]
        assert isinstance(events[-1], Done)  # under the byte quota when it began; its KV takes it over
        refused = [e async for e in a.chat(first, token, "And the gulls?", {"max_tokens": 4}, owner="o1")][-1]
        assert isinstance(refused, TurnFailed) and refused.code == "quota_exceeded"
        await a.delete_session(first, token, owner="o1")
        await a.create_session(new_session_id(), mode="tiered", owner="o1")  # room again
    finally:
        await a.close()


async def test_an_evicting_policy_found_after_a_reconnect_stops_saves_until_it_is_fixed(make_engine, private_redis):
    """Redis restarted (or failed over) with another configuration: read again when it answers again."""
    ns = f"rkvpolicy-{secrets.token_hex(3)}"
    a = replica(make_engine, private_redis.url, ns, "a")
    try:
        sid, token = await new_session(a)
        private_redis.client().config_set("maxmemory-policy", "volatile-lru")
        a.store.client.reconnects += 1  # as a call answering after the circuit had opened counts it
        await a._check_store()
        done = await turn(a, sid, token, "What did the keeper write about?")
        assert not done.storage.saved and "maxmemory-policy" in (await a.health())["redis"]["error"]
        private_redis.client().config_set("maxmemory-policy", "noeviction")
        a.store.client.reconnects += 1
        await a._check_store()
        await a.repository.save_unsaved(a.access.digest)
        assert a.repository.stored(sid) and (await a.health())["redis"]["ok"]
    finally:
        await a.close()


async def test_a_full_redis_that_cannot_take_spills_refuses_turns_whole(make_engine, private_redis):
    """Pages that must spill (a host tier smaller than the history's cold pages) cannot, Redis being full:
    the turn is refused with a structured error and undone, never half-applied; once Redis has room, the
    same message runs."""
    a = replica(make_engine, private_redis.url, f"rkvfull-{secrets.token_hex(3)}", "a", host_tier_bytes=1 << 20)
    try:
        sid, token = await new_session(a)
        full(private_redis)
        for _ in range(2):  # the first finds Redis full mid-turn; the next is refused at admission
            failed = (await events_of(a, sid, token, LONG + " What did the keeper write about?"))[-1]
            assert isinstance(failed, TurnFailed) and failed.code == "host_memory_exhausted", failed
        users = [m["content"] for m in (await a.get_session(sid, token))["messages"] if m["role"] == "user"]
        assert users == [LONG]  # undone: the history is as before
        roomy(private_redis)
        a.engine.redis._full_until = 0.0  # as after the back-off, when the next spill looks again
        done = await turn(a, sid, token, LONG + " What did the keeper write about?")
        assert done.storage.saved
    finally:
        await a.close()
