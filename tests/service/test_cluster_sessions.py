"""Sessions on a real local Redis Cluster (three masters on loopback): a conversation resumed on
another replica with its KV, and the loss of one master. Real model; two services (engine and
``ChatService`` each) stand for two replicas of one deployment."""
from __future__ import annotations

import asyncio
import time

from redis_cluster import RedisCluster, local_cluster, namespace_on_one_node

from app.chat_service import ChatService
from app.contract.events import Delta, Done, TurnFailed
from app.contract.ids import new_session_id
from app.session_store import SessionStore
from tiers.store.redis.keys import owner_key, session_key

LONG = "The lighthouse keeper wrote about the storm, the gulls and the ships that passed by. " * 6
LATER = ("What did the keeper write about?", "And the ships?")


def replica(make_engine, url: str, ns: str, name: str) -> ChatService:
    # A short retry: a shard that comes back is probed again within the test's patience.
    engine = make_engine(mode="tiered", token_budget=32, page_tokens=8, redis_url=url, redis_namespace=ns,
                         redis_timeout_s=1.0, redis_retry_s=0.2)
    return ChatService(engine, name, SessionStore(engine.redis.client, ns))


async def turn(service: ChatService, sid: str, token: str, text: str) -> tuple[str, Done | TurnFailed]:
    """The reply's text and the turn's last event."""
    events = [e async for e in service.chat(sid, token, text, {"max_tokens": 4})]
    return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]


async def done(service: ChatService, sid: str, token: str, text: str) -> tuple[str, Done]:
    reply, last = await turn(service, sid, token, text)
    assert isinstance(last, Done), last
    return reply, last


async def new_session(service: ChatService, cluster: RedisCluster, port: int | None = None) -> tuple[str, str]:
    """A tiered session (its first turn taken) whose slot ``port``'s master serves (any, with None)."""
    sid = new_session_id()
    while port is not None and cluster.node_of(session_key(service.store.ns, sid)) != port:
        sid = new_session_id()
    token = (await service.create_session(sid, mode="tiered"))["token"]
    await done(service, sid, token, LONG)
    return sid, token


async def reference_reply(service: ChatService, cluster: RedisCluster) -> str:
    """The third turn's reply of a conversation that never moved (greedy decoding: one right answer)."""
    sid, token = await new_session(service, cluster)
    await done(service, sid, token, LATER[0])
    return (await done(service, sid, token, LATER[1]))[0]


async def test_a_conversation_moves_to_another_replica_with_its_kv(make_engine, tmp_path):
    with local_cluster(tmp_path) as cluster:
        ns = namespace_on_one_node(cluster, "rkvcl")
        a, b = (replica(make_engine, cluster.url, ns, name) for name in ("a", "b"))
        try:
            sid, token = await new_session(a, cluster)
            await done(a, sid, token, LATER[0])
            fed = a.engine.sessions[sid].fed_tokens
            reply, moved = await done(b, sid, token, LATER[1])  # b restores it from the cluster
            assert b.engine.sessions[sid].cache is not None
            # Only the new turn is prefilled: the KV of the history came back from its shard.
            assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed < 40
            assert reply == await reference_reply(a, cluster)
            assert {s["session_id"] for s in await b.store.summaries()} >= {sid}
        finally:
            await a.close()
            await b.close()


async def test_losing_a_master_stops_only_the_sessions_on_its_shard(make_engine, tmp_path):
    with local_cluster(tmp_path) as cluster:
        ns = namespace_on_one_node(cluster, "rkvcl")
        keeper = cluster.node_of(owner_key(ns, None))  # the listing's and the totals' node stays up
        victim = next(p for p in cluster.ports if p != keeper)
        a, b = (replica(make_engine, cluster.url, ns, name) for name in ("a", "b"))
        try:
            live, live_token = await new_session(a, cluster, keeper)
            dead, dead_token = await new_session(a, cluster, victim)
            cluster.kill_node(victim)

            # The sessions on the live shards take turns and save them; so does another replica.
            before = await a.store.stored(live)
            await done(a, live, live_token, LATER[0])
            after = await a.store.stored(live)
            assert after.tag != before.tag and after.lineage[-2:] == (before.tag, after.tag)
            fed = a.engine.sessions[live].fed_tokens
            reply, moved = await done(b, live, live_token, LATER[1])
            assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed

            # The dead shard's session goes on from a's memory, unsaved; nowhere else can restore it.
            await done(a, dead, dead_token, LATER[0])
            assert a.repository.unsaved == 1
            _, refused = await turn(b, dead, dead_token, LATER[1])
            assert isinstance(refused, TurnFailed) and refused.code == "store_unavailable"

            # Listings leave out what they cannot read; totals and health answer.
            listed = {s["session_id"] for s in await a.store.summaries()}
            assert live in listed and dead not in listed
            await a.repository.push_stats()
            assert {s["replica"] for s in await a.store.replica_stats()} >= {"a"}
            assert (await a.health())["redis"]["ok"] is False

            # The master comes back empty: a's housekeeping saves the session again, KV included.
            cluster.start_node(victim)
            cluster.wait_ok()
            deadline = time.monotonic() + 60
            while a.repository.unsaved or (await a.store.stored(dead)).tag is None:
                assert time.monotonic() < deadline, "the session was not saved again"
                await asyncio.sleep(0.2)
            fed = a.engine.sessions[dead].fed_tokens
            resumed_reply, resumed = await done(b, dead, dead_token, LATER[1])
            assert resumed.usage.prefilled_tokens == resumed.usage.prompt_tokens - fed
            assert resumed_reply == reply  # the same conversation: the same KV, the same reply
        finally:
            await a.close()
            await b.close()
