"""The commit of a session record on a real Redis: fenced by a tag, it makes the KV groups it names live
as long as the record, deletes those the record before named and it does not, refuses to name a group
that is not whole, and says what the save can promise (a Redis replica's acknowledgement, fsync, or
memory). Deletes take the KV with the record; listings and quotas read a per-owner index that forgets
what expired."""
from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time

import pytest
import redis

from redis_cluster import missing_reason
from serving_helpers import RedisServer, free_port

from app.session_store import DELETED, KV_MISSING, MOVED, SAVED, SessionStore
from tiers.store.redis.client import RedisClient
from tiers.store.redis.config import StoreConfig
from tiers.store.redis.keys import kv_key, session_key


@pytest.fixture
def stores(redis_url):
    ns = f"rkvcommit-{secrets.token_hex(3)}"
    client = RedisClient(redis_url)
    store = SessionStore(client, ns, ttl_s=1000, pending_ttl_s=60)
    raw = redis.Redis.from_url(redis_url)
    yield store, raw
    for key in raw.scan_iter(match=f"{ns}:*"):
        raw.delete(key)
    client.close()


def save(store, sid, expected, tag, lineage, groups, owner=None, nbytes=0):
    data = {"id": sid, "owner": owner, "messages": []}
    return asyncio.run(store.save(data, {"owner": owner}, expected, tag, lineage, groups, nbytes))


def group(raw, store, sid, name, items, ttl=60):
    key = kv_key(store.ns, sid, name)
    raw.hset(key, mapping={str(i): b"x" for i in range(items)})
    raw.expire(key, ttl)
    return key


def test_a_commit_is_fenced_by_the_tag_and_takes_over_the_kv_lifetimes(stores):
    store, raw = stores
    a1, b1 = group(raw, store, "s", "p1", 2), group(raw, store, "s", "g1", 2)
    first = save(store, "s", None, "t1", ["t1"], {"p1": 2, "g1": 2})
    assert first.outcome == SAVED and raw.ttl(a1) > 1000 and raw.ttl(b1) > 1000  # record TTL + a quarter
    assert save(store, "s", None, "tx", ["tx"], {}).outcome == MOVED  # "must not exist" meets a record
    stale = save(store, "s", "t0", "tx", ["t0", "tx"], {})
    assert stale.outcome == MOVED and stale.stored.tag == "t1" and stale.stored.lineage == ("t1",)
    # The next commit names p1 and p2 with its own tables: g1, which only the record before named, goes.
    a2 = group(raw, store, "s", "p2", 1)
    b2 = group(raw, store, "s", "g2", 2)
    assert save(store, "s", "t1", "t2", ["t1", "t2"], {"p1": 2, "p2": 1, "g2": 2}).outcome == SAVED
    assert not raw.exists(b1) and raw.exists(a1) and raw.ttl(a2) > 1000 and raw.ttl(b2) > 1000
    data, stored = asyncio.run(store.load("s"))
    assert data["id"] == "s" and stored.tag == "t2" and stored.lineage == ("t1", "t2")


def test_a_commit_naming_kv_that_is_not_whole_writes_nothing(stores):
    store, raw = stores
    group(raw, store, "s", "p1", 1)
    missing = save(store, "s", None, "t1", ["t1"], {"p1": 2})
    assert missing.outcome == KV_MISSING and missing.missing == "p1"
    assert not raw.exists(session_key(store.ns, "s"))


def test_a_record_without_kv_leaves_the_groups_before_it_pending(stores):
    store, raw = stores
    key = group(raw, store, "s", "p1", 1)
    save(store, "s", None, "t1", ["t1"], {"p1": 1})
    assert save(store, "s", "t1", "t2", ["t1", "t2"], None).outcome == SAVED
    assert raw.exists(key) and 0 < raw.ttl(key) <= 60  # its holder renews it while its cache needs it


def test_a_delete_takes_the_kv_its_record_named_and_no_save_comes_back(stores):
    store, raw = stores
    key = group(raw, store, "s", "p1", 1)
    save(store, "s", None, "t1", ["t1"], {"p1": 1}, owner="o1")
    asyncio.run(store.delete("s", "o1"))
    assert not raw.exists(key) and asyncio.run(store.load("s")) is None
    assert asyncio.run(store.stored("s")).deleted
    assert save(store, "s", "t1", "t2", ["t1", "t2"], {}).outcome == DELETED


def test_listings_and_usage_are_per_owner_and_forget_what_expired(stores):
    store, raw = stores
    save(store, "a1", None, "t", ["t"], {}, owner="o1", nbytes=100)
    save(store, "a2", None, "t", ["t"], {}, owner="o1", nbytes=50)
    save(store, "b1", None, "t", ["t"], {}, owner="o2", nbytes=7)
    assert [s["owner"] for s in asyncio.run(store.summaries(owner="o1"))] == ["o1", "o1"]
    assert asyncio.run(store.owners.usage("o1")) == (2, 150)
    asyncio.run(store.owners.put("o1", "a1", -1, 100))  # a1's record expired (by Redis's clock)
    assert asyncio.run(store.owners.usage("o1")) == (1, 50)
    raw.delete(session_key(store.ns, "a2"))  # gone without the index knowing: the listing drops it
    assert asyncio.run(store.summaries(owner="o1")) == [] and asyncio.run(store.owners.usage("o1")) == (0, 0)
    assert asyncio.run(store.owners.usage("o2")) == (1, 7)


def test_the_owner_index_keeps_time_by_redis_not_by_a_replica_s_clock(stores, monkeypatch):
    """A replica whose clock runs a day ahead neither forgets the sessions others indexed nor keeps its own
    past their records' expiry: every time the index compares is Redis's."""
    store, _ = stores
    save(store, "a1", None, "t", ["t"], {}, owner="o1", nbytes=10)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 86_400)  # records here live 1,000 s
    save(store, "a2", None, "t", ["t"], {}, owner="o1", nbytes=5)
    assert asyncio.run(store.owners.usage("o1")) == (2, 15)
    assert len(asyncio.run(store.summaries(owner="o1"))) == 2


def test_a_save_promises_what_redis_gives(tmp_path):
    """No replica: in memory, unless Redis fsyncs every write. A replica that takes the write: replicated."""
    os.makedirs(tmp_path / "primary")
    with RedisServer(tmp_path / "primary") as primary:
        port = free_port()
        os.makedirs(tmp_path / "replica")
        subprocess.run(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path / "replica"),
                        "--replicaof", "127.0.0.1", str(primary.port), "--daemonize", "yes", "--save", "",
                        "--logfile", str(tmp_path / "replica" / "log")], check=True)
        replica = redis.Redis(port=port)
        try:
            deadline = time.monotonic() + 20
            while replica.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline
                time.sleep(0.1)
            client = RedisClient(primary.url)
            try:
                fsync = SessionStore(client, "rkvd", config=lambda: StoreConfig("noeviction", "always"))
                assert save(fsync, "s1", None, "t", ["t"], {}).saved.durability == "fsync"
                evicting = SessionStore(client, "rkvd", config=lambda: StoreConfig("allkeys-lru", "always"))
                promise = save(evicting, "s0", None, "t", ["t"], {}).saved  # allowed knowingly: never durable
                assert promise.saved and not promise.durable and promise.durability == "memory"
                memory = SessionStore(client, "rkvd", config=lambda: StoreConfig("noeviction", "everysec"))
                promise = save(memory, "s2", None, "t", ["t"], {}).saved
                assert not promise.durable and promise.durability == "memory"
                waiting = SessionStore(client, "rkvd", min_replicas=1, wait_timeout_s=2)
                promise = save(waiting, "s3", None, "t", ["t"], {}).saved
                assert promise.durable and promise.durability == "replicated" and promise.replicas == 1
                assert replica.hget(session_key("rkvd", "s3"), "tag") == b"t"
                too_many = SessionStore(client, "rkvd", min_replicas=2, wait_timeout_s=0.2)
                assert save(too_many, "s4", None, "t", ["t"], {}).saved.durability == "memory"
            finally:
                client.close()
        finally:
            replica.shutdown(nosave=True)


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_on_a_cluster_a_save_waits_for_the_replica_of_its_own_shard(tmp_path):
    """The commit and its ``WAIT`` go to the primary of the session's slot, on one connection: every
    session, whichever shard it hashes to, is acknowledged by that shard's replica."""
    from bench.soak_redis import ClusterTopology

    with ClusterTopology(tmp_path, host="127.0.0.1") as cluster:
        client = RedisClient(cluster.url)
        try:
            store = SessionStore(client, "rkvcl", min_replicas=1, wait_timeout_s=2)
            promises = [save(store, f"s{i}", None, "t", ["t"], {}).saved for i in range(6)]
            assert {p.durability for p in promises} == {"replicated"} and {p.replicas for p in promises} == {1}
            shards = {client.redis.get_node_from_key(session_key("rkvcl", f"s{i}")).name for i in range(6)}
            assert len(shards) > 1  # the sessions spread over shards, each acknowledged by its own replica
        finally:
            client.close()


def test_a_commit_sent_again_after_a_lost_reply_is_its_own_and_a_listing_failure_fails_no_save(stores):
    """A reply lost after the script ran (a timeout, a reset) and the commit sent again: it finds its own
    tag, so it is acknowledged, not taken for another replica's. The owner's listing, updated after the
    commit, cannot fail a save that committed."""
    store, raw = stores
    assert save(store, "s", None, "t1", ["t1"], {}).outcome == SAVED
    assert save(store, "s", None, "t1", ["t1"], {}).outcome == SAVED
    raw.set(f"{store.ns}:owner:{{o9}}", b"not a sorted set")  # the listing's script now fails
    assert save(store, "s", "t1", "t2", ["t1", "t2"], {}, owner="o9").outcome == SAVED
    assert asyncio.run(store.stored("s")).tag == "t2"


def test_a_record_written_before_tags_is_taken_over_by_its_version(stores):
    """An upgrade meets records with an integer ``version`` and no tag: the version stands in for the tag,
    so the copy that loaded one saves over it as its own, and a stale one is still told apart."""
    store, raw = stores
    raw.hset(f"{store.ns}:session:{{old}}", mapping={"version": 3, "data": '{"id": "old"}', "summary": "{}"})
    data, stored = asyncio.run(store.load("old"))
    assert stored.tag == "v3" and asyncio.run(store.stored("old")).tag == "v3"
    assert save(store, "old", "v2", "t", ["v2", "t"], {}).outcome == MOVED
    assert save(store, "old", "v3", "t", ["v3", "t"], {}).outcome == SAVED
