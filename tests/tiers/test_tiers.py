"""The host tier over the page store on the real Redis: the host bound, spills and promotions that keep
every byte, Redis outages, reservations, and the store's lifetimes (pending, renewed by the holder).
The wire format and the store's own calls: ``test_page_store``."""
import secrets
import threading
import time

import pytest
import redis
import torch

from tiers.host.tier import HostFull, HostTier
from tiers.store.redis.client import RedisClient
from tiers.store.redis.keys import kv_key
from tiers.store.redis.pages import RedisPageStore

DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: every call fails fast


def clear(redis_url: str, ns: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    for key in raw.scan_iter(match=f"{ns}:*"):
        raw.delete(key)


@pytest.fixture
def page_store(redis_url):
    store = RedisPageStore(RedisClient(redis_url), namespace=f"rkvtest-{secrets.token_hex(4)}", pending_ttl_s=600)
    yield store
    clear(redis_url, store.ns)
    store.close()


def make_page(seed: int, dtype=torch.float32, p=16, d=8) -> dict[str, torch.Tensor]:
    """One page's tensors (no page axis), as the page store keeps them."""
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(p, d, generator=g).to(dtype), "values": torch.randn(p, d, generator=g).to(dtype)}


def stacked(*pages) -> dict[str, torch.Tensor]:
    return {name: torch.stack([page[name] for page in pages]) for name in pages[0]}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[f].dtype == b[f].dtype and torch.equal(a[f].view(torch.uint8), b[f].view(torch.uint8)) for f in a
    )


def where(host: HostTier, sid: str, pid: str) -> str:
    return host.where_many(sid, [pid])[0]


PAGE_BYTES = 2 * 16 * 8 * 4


def test_the_store_counts_what_it_holds_writes_and_reads(page_store):
    assert page_store.put("s1", {"c/1": make_page(1), "c/2": make_page(2, torch.bfloat16)})
    back = page_store.get("s1", ["c/2", "c/9", "c/1"])
    assert back[1] is None and same(back[0], make_page(2, torch.bfloat16)) and same(back[2], make_page(1))
    stats = page_store.stats
    assert stats.entries == 2 and stats.bytes > 0 and stats.hits == 2 and stats.misses == 1
    assert stats.bytes_read == stats.bytes_written == stats.bytes == page_store.session_bytes("s1")


def test_a_sessions_items_are_one_key_per_group_and_nothing_else(page_store, redis_url):
    """No manifest, no writers' log: what a write leaves under the namespace is its groups' hashes,
    pending (the store's short TTL), and deleting the groups leaves nothing."""
    page_store.put("s1", {"p1/0.0": make_page(2), "p1/1.0": make_page(3), "p2/0.0": make_page(4)})
    client = redis.Redis.from_url(redis_url)
    keys = {k.decode() for k in client.scan_iter(match=f"{page_store.ns}:*")}
    # One hash tag per session (one cluster slot), one hash per group.
    assert keys == {kv_key(page_store.ns, "s1", "p1"), kv_key(page_store.ns, "s1", "p2")}
    assert all(0 < client.ttl(k) <= page_store.pending_ttl_s for k in keys)
    assert page_store.delete("s1", ["p1", "p2"])
    assert list(client.scan_iter(match=f"{page_store.ns}:*")) == [] and page_store.stats.bytes == 0


def test_host_bound_holds_and_spill_promote_keeps_every_byte(page_store):
    pages = {f"c/{i}": make_page(i) for i in range(10)}
    host = HostTier(capacity_bytes=3 * PAGE_BYTES, store=page_store)
    for cid, page in pages.items():
        assert host.put_many("s2", [cid], stacked(page)) == PAGE_BYTES
        assert host.stats.bytes <= host.capacity_bytes
    assert host.stats.entries == 3 and host.stats.spills == 7
    assert {where(host, "s2", cid) for cid in pages} == {"host", "redis"}
    for cid, page in pages.items():  # reading spilled pages promotes them back, spilling others
        got, from_redis = host.read_many("s2", [cid])
        assert same({k: t[0] for k, t in got.items()}, page)
        assert host.stats.bytes <= host.capacity_bytes
    assert host.stats.promotions >= 7
    host.free_many("s2", list(pages))
    assert host.stats.entries == 0 and host.stats.bytes == 0


def test_a_spill_checks_that_redis_still_holds_a_page_before_dropping_its_host_copy(page_store, redis_url):
    """A page read back from Redis is in the host tier and believed in Redis; if its key went (expired,
    or Redis restarted empty), spilling it again must write it, not drop the last copy."""
    pages = {f"c/{i}": make_page(200 + i) for i in range(3)}
    host = HostTier(capacity_bytes=2 * PAGE_BYTES, store=page_store)
    for cid, page in pages.items():
        host.put_many("s2", [cid], stacked(page))
    assert where(host, "s2", "c/0") == "redis"
    host.read_many("s2", ["c/0"])  # back in a slot (c/1 spilled for it), still believed in Redis
    assert where(host, "s2", "c/0") == "host" and host.copies.holds("s2", "c/0")
    redis.Redis.from_url(redis_url).hdel(kv_key(page_store.ns, "s2", "c"), "0")  # the copy of c/0 is lost
    host.read_many("s2", ["c/1"])  # c/0, least recently used, spills to make room
    host.read_many("s2", ["c/2"])
    assert where(host, "s2", "c/0") == "redis"
    got, from_redis = host.read_many("s2", ["c/0"])
    assert from_redis == PAGE_BYTES and same({k: t[0] for k, t in got.items()}, pages["c/0"])


def test_a_read_larger_than_the_host_tier_returns_every_page_intact(page_store):
    """One read of more pages than the pool holds: each page comes back as written, whatever the
    read spills and promotes on the way (no view of a reused slot)."""
    pages = {f"c/{i}": make_page(100 + i) for i in range(12)}
    host = HostTier(capacity_bytes=4 * PAGE_BYTES, store=page_store)
    host.put_many("s2", list(pages), stacked(*pages.values()))
    assert host.stats.bytes <= host.capacity_bytes and host.stats.spills >= 8
    order = ["c/3", "c/11", "c/0", "c/7", "c/1", "c/10", "c/2", "c/9", "c/4", "c/8", "c/5", "c/6", "c/3"]
    got, from_redis = host.read_many("s2", order)
    assert from_redis > 0
    for i, cid in enumerate(order):
        assert same({k: t[i] for k, t in got.items()}, pages[cid]), cid
    host.free_many("s2", list(pages))


def test_redis_down_host_keeps_its_bound_and_every_page_it_took():
    dead = RedisPageStore(RedisClient(DEAD_URL, timeout_s=0.3), namespace="rkvtest-dead")
    try:
        assert dead.put("s", {"c/0": make_page(3)}) is False
        assert dead.client.healthy is False and dead.stats.errors >= 1 and dead.last_error
        host = HostTier(capacity_bytes=2 * PAGE_BYTES, store=dead)
        for i in range(2):
            host.put_many("s", [f"c/{i}"], stacked(make_page(i)))
        # Nothing can spill: a page past the bound is refused, whole, and the tier stays within it.
        with pytest.raises(HostFull, match="the store is unavailable"):
            host.put_many("s", ["c/2", "c/3"], stacked(make_page(2), make_page(3)))
        assert host.stats.bytes == 2 * PAGE_BYTES and host.exhausted == 1
        assert [where(host, "s", f"c/{i}") for i in range(4)] == ["host", "host", "none", "none"]
        got, _ = host.read_many("s", ["c/0", "c/1"])
        assert all(same({k: t[i] for k, t in got.items()}, make_page(i)) for i in range(2))
    finally:
        dead.close()


def test_without_redis_a_store_past_the_bound_is_refused_and_reservations_hold_room():
    host = HostTier(capacity_bytes=4 * PAGE_BYTES, page_bytes=PAGE_BYTES)
    assert host.max_slots == 4 and host.reserve("a", 3)
    assert not host.reserve("b", 2) and host.refused == 1  # only one slot is not held for "a"
    with pytest.raises(HostFull, match="no store"):
        host.put_many("b", ["p0", "p1"], stacked(make_page(0), make_page(1)))
    host.put_many("b", ["p0"], stacked(make_page(0)))  # the one slot nobody holds
    host.put_many("a", ["p0", "p1", "p2"], stacked(*(make_page(i) for i in range(3))))
    assert host.stats.bytes == 4 * PAGE_BYTES == host.capacity_bytes
    with pytest.raises(HostFull):
        host.put_many("a", ["p3"], stacked(make_page(3)))
    host.free_many("b", ["p0"])  # a freed slot serves the next store
    host.release("a")
    assert host.reserve("b", 1) and host.put_many("b", ["p1"], stacked(make_page(1))) == PAGE_BYTES
    assert host.session_bytes("a") == 3 * PAGE_BYTES and host.session_bytes("b") == PAGE_BYTES
    host.drop_session("a")
    assert host.session_bytes("a") == 0 and host.stats.bytes == PAGE_BYTES and host.free_bytes() == 3 * PAGE_BYTES


def test_room_set_aside_for_an_ended_turns_job_outlives_the_sessions_next_turn():
    # Without Redis: a session's turn holds 2 of 4 slots; it ends with a job still to demote pages, so
    # its room is set aside. The session's next turn reserves (and is released) apart from it; other
    # sessions see the set-aside slots held until the job's holder is released.
    host = HostTier(capacity_bytes=4 * PAGE_BYTES, page_bytes=PAGE_BYTES)
    assert host.reserve("a", 2)
    host.set_aside("a", "a#job0")
    assert host.reserved_bytes() == 2 * PAGE_BYTES
    assert not host.reserve("a", 3)  # two slots are free beside what was set aside, not four
    assert host.reserve("a", 1) and host.reserved_bytes() == 3 * PAGE_BYTES  # the next turn's, beside it
    host.release("a")  # the next turn refused or ended
    assert host.reserved_bytes() == 2 * PAGE_BYTES and not host.reserve("b", 3) and host.reserve("b", 2)
    host.release("b")
    # The job's stores fill what was set aside first, then what the session's turn holds.
    assert host.reserve("a", 2)
    host.put_many("a", ["p0", "p1", "p2"], stacked(*(make_page(i) for i in range(3))))
    assert host.reserved_bytes() == PAGE_BYTES  # 2 + 2 held, 3 filled
    host.release("a#job0")
    assert host.reserved_bytes() == PAGE_BYTES  # the turn's last slot: set-aside room was filled first
    host.set_aside("a", "a#job1")
    host.drop_session("a")
    assert host.reserved_bytes() == 0 and host.stats.bytes == 0  # a dropped session holds nothing


def test_host_tier_calls_run_one_at_a_time():
    """The page reader demotes one session's pages while the model thread reads another's: a call waits
    while another holds the tier, then completes intact."""
    host = HostTier(capacity_bytes=8 * PAGE_BYTES)
    host.put_many("a", ["p0"], stacked(make_page(0)))
    done = threading.Event()

    def store_b():
        host.put_many("b", ["p0"], stacked(make_page(1)))
        done.set()

    with host.lock:  # another call in progress
        worker = threading.Thread(target=store_b)
        worker.start()
        assert not done.wait(0.3)
    worker.join(5)
    assert done.is_set()
    for sid, seed in (("a", 0), ("b", 1)):
        got, _ = host.read_many(sid, ["p0"])
        assert same(got, stacked(make_page(seed)))


def test_what_a_dead_holder_left_expires_and_what_a_live_holder_renews_stays(redis_url):
    """No sweeper: pages a process spilled and no record names are pending; one that died (never renews)
    leaves them to expire after the short TTL, while a live holder renews its own and reads them back."""
    ns = f"rkvtest-{secrets.token_hex(4)}"
    stores = [RedisPageStore(RedisClient(redis_url), namespace=ns, pending_ttl_s=2) for _ in range(2)]
    dead, live = (HostTier(capacity_bytes=PAGE_BYTES, store=store) for store in stores)
    try:
        for host, sid in ((dead, "s1"), (live, "s2")):
            host.put_many(sid, ["c/0"], stacked(make_page(0)))
            host.put_many(sid, ["c/1"], stacked(make_page(1)))  # c/0 spills: its group is pending
            assert where(host, sid, "c/0") == "redis"
        time.sleep(1.0)
        assert live.renew_pending() == 1  # the live holder's one pending group; the dead one renews nothing
        time.sleep(1.2)  # past the first TTL, within the renewed one
        client = redis.Redis.from_url(redis_url)
        assert not client.exists(kv_key(ns, "s1", "c")) and client.exists(kv_key(ns, "s2", "c"))
        got, from_redis = live.read_many("s2", ["c/0"])
        assert from_redis == PAGE_BYTES and same({k: t[0] for k, t in got.items()}, make_page(0))
    finally:
        clear(redis_url, ns)
        for store in stores:
            store.close()
