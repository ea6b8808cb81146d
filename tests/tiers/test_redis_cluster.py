"""The page store and the session records on a real local Redis Cluster (three masters on loopback):
one session, one slot; a read of N pages, one round trip to one shard; scripts and circuits per shard."""
from __future__ import annotations

import asyncio
import secrets
import time

import pytest
import torch
from redis.asyncio.connection import AbstractConnection
from redis_cluster import local_cluster

from app.session_store import SAVED, SessionStore, new_tag
from tiers.store.redis.client import RedisClient
from tiers.store.redis.keys import kv_key, session_key
from tiers.store.redis.pages import RedisPageStore
from tiers.store.redis.url import is_cluster, parse_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture
def on_cluster(cluster):
    """A client, the page store and the records over it, in a fresh namespace."""
    client = RedisClient(cluster.url, timeout_s=2.0, retry_s=0.2)
    ns = f"rkvcl-{secrets.token_hex(3)}"
    yield client, RedisPageStore(client, ns), SessionStore(client, ns, ttl_s=600)
    client.close()


def page(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(8, 16, generator=g), "values": torch.randn(8, 16, generator=g)}


async def save(store: SessionStore, sid: str, expected: str | None, groups: dict[str, int]) -> tuple[str, str]:
    """A record of ``sid`` naming ``groups``, by compare-and-set on ``expected``: (the outcome, its tag)."""
    tag = new_tag()
    result = await store.save({"id": sid}, {"session_id": sid, "owner": None}, expected, tag, [tag], groups)
    return result.outcome, tag


def sid_on(cluster, ns: str, port: int, avoid: int | None = None) -> str:
    """A fresh session id whose slot ``port`` serves (or any but ``avoid``'s, with ``port`` None)."""
    while True:
        sid = secrets.token_hex(8)
        node = cluster.node_of(session_key(ns, sid))
        if node == port or (port is None and node != avoid):
            return sid


def test_cluster_urls_name_their_nodes_and_bad_ones_say_why():
    parsed = parse_cluster("redis+cluster://user:p%40ss@10.0.0.1:7000, redis-b:7001,[::1]:7002")
    assert parsed.nodes == (("10.0.0.1", 7000), ("redis-b", 7001), ("::1", 7002))
    assert (parsed.username, parsed.password, parsed.ssl) == ("user", "p@ss", False)
    assert parse_cluster("rediss+cluster://h:1").ssl and is_cluster("REDIS+CLUSTER://h:1")
    assert not is_cluster("redis://127.0.0.1:6379/0")
    for bad in ("redis+cluster://h", "redis+cluster://h:1,", "redis+cluster://h:1/0", "redis://h:1"):
        with pytest.raises(ValueError):
            parse_cluster(bad)


async def test_a_sessions_record_and_kv_share_one_slot_on_one_node(cluster, on_cluster):
    _, pages, store = on_cluster
    ns, sid = pages.ns, secrets.token_hex(8)
    names = [f"p{i % 3}/{i}.0" for i in range(12)]  # three turns' groups
    assert pages.put(sid, {name: page(i) for i, name in enumerate(names)})
    assert (await save(store, sid, None, {"p0": 4, "p1": 4, "p2": 4}))[0] == SAVED  # the script saw them whole
    keys = [session_key(ns, sid), *(kv_key(ns, sid, g) for g in ("p0", "p1", "p2"))]
    assert len({cluster.client().cluster("keyslot", k) for k in keys}) == 1
    owner = cluster.node_of(keys[0])
    for port in cluster.ports:  # every key of the session on its slot's node, none elsewhere
        held = {k.decode() for k in cluster.client(port).keys(f"{ns}:session:*")}
        assert held == (set(keys) if port == owner else set())
    assert [s["session_id"] for s in await store.summaries()] == [sid]


def test_a_read_of_n_pages_is_one_round_trip_to_the_sessions_shard(cluster, on_cluster, monkeypatch):
    _, store, _ = on_cluster
    sid, n, groups = secrets.token_hex(8), 24, 4
    pages = {f"p{i % groups}/0.{i}": page(i) for i in range(n)}
    assert store.put(sid, pages)
    store.get(sid, ["p0/0.0"])  # the connection to the shard is open: no handshake below
    owner = cluster.node_of(session_key(store.ns, sid))
    before = {port: hmget_calls(cluster, port) for port in cluster.ports}
    sends: list[int] = []
    send = AbstractConnection.send_packed_command

    async def counted(self, command, check_health=True):
        sends.append(self.port)
        return await send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    got = store.get(sid, list(pages))
    monkeypatch.undo()
    assert sends == [owner]  # one write of the whole pipeline, to one node, answered in one read loop
    assert all(torch.equal(g["keys"], p["keys"]) for g, p in zip(got, pages.values()))
    for port in cluster.ports:  # one HMGET a group, not one read a page
        assert hmget_calls(cluster, port) - before[port] == (groups if port == owner else 0)


def hmget_calls(cluster, port: int) -> int:
    return cluster.client(port).info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)


async def test_a_save_loads_its_script_on_its_own_node_only(cluster, on_cluster):
    """A node that lost its scripts (restarted, or flushed) gets the script by EVAL there: nothing is
    sent to the other primaries, which may be down."""
    _, _, store = on_cluster
    sid = secrets.token_hex(8)
    for port in cluster.ports:
        cluster.client(port).script_flush()
    outcome, tag = await save(store, sid, None, {})
    assert outcome == SAVED
    owner = cluster.node_of(store.key(sid))
    loaded = {port: cluster.client(port).script_exists(store._commit.sha)[0] for port in cluster.ports}
    assert loaded == {port: port == owner for port in cluster.ports}
    assert (await save(store, sid, tag, {}))[0] == SAVED


async def test_replica_totals_live_in_one_hash_and_expire_by_redis_clock(cluster, on_cluster):
    client, _, store = on_cluster
    await store.put_replica_stats("a", {"sessions": 2}, ttl_s=30)
    await store.put_replica_stats("b", {"sessions": 3}, ttl_s=1)
    assert sorted(s["sessions"] for s in await store.replica_stats()) == [2, 3]
    await asyncio.sleep(2.1)
    assert await store.replica_stats() == [{"sessions": 2}]
    raw = cluster.cluster_client()
    assert raw.hkeys(f"{store.ns}:replicas") == [b"a"]  # the expired field was removed by the read
    await store.drop_replica_stats("a")
    assert await store.replica_stats() == [] and client.circuit()["redis_circuit_open"] == 0
    raw.close()


def test_a_dead_shard_opens_its_own_circuit_and_the_others_serve(tmp_path):
    with local_cluster(tmp_path) as cluster:
        client = RedisClient(cluster.url, timeout_s=1.0, retry_s=0.2)
        store = RedisPageStore(client, f"rkvcl-{secrets.token_hex(3)}")
        try:
            victim = cluster.ports[0]
            dead, live = sid_on(cluster, store.ns, victim), sid_on(cluster, store.ns, None, avoid=victim)
            for sid in (dead, live):
                assert store.put(sid, {"p1/0.0": page(1)})
            cluster.kill_node(victim)
            started = time.monotonic()
            assert store.get(dead, ["p1/0.0"]) == [None]  # refused by the dead node: no wrong bytes
            assert store.unavailable(dead) and not store.unavailable(live) and not store.unavailable()
            assert store.get(dead, ["p1/0.0"]) == [None] and client.breaker_of(session_key(store.ns, dead)).refused == 1
            assert torch.equal(store.get(live, ["p1/0.0"])[0]["keys"], page(1)["keys"])
            assert store.put(live, {"p2/0.0": page(2)}) and time.monotonic() - started < 5
            assert client.circuit()["redis_circuit_open"] == 1
            cluster.start_node(victim)  # back, empty: the dead shard's session lost its page
            cluster.wait_ok()
            deadline = time.monotonic() + 10
            while not store.put(dead, {"p1/0.0": page(3)}):  # the next probe closes its circuit
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert torch.equal(store.get(dead, ["p1/0.0"])[0]["keys"], page(3)["keys"])
            assert client.circuit()["redis_circuit_open"] == 0
        finally:
            client.close()
