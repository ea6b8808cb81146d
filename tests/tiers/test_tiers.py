"""Tiers against the real Redis: bit-exact round trips, the host bound, spills, and Redis outages."""
import secrets
import threading

import pytest
import redis
import torch

from tiers.host import HostFull, HostTier
from tiers.redis_client import RedisClient
from tiers.redis_tier import WRITER_TTL_S, RedisTier, decode_tensors, encode_tensors

DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: every call fails fast


@pytest.fixture
def redis_tier(redis_url):
    tier = RedisTier(RedisClient(redis_url), namespace=f"rkvtest-{secrets.token_hex(4)}", ttl_s=600)
    yield tier
    tier.delete_session("s1")
    tier.delete_session("s2")
    tier.close()


def make_page(seed: int, dtype=torch.float32, p=16, d=8) -> dict[str, torch.Tensor]:
    """One page's tensors (no page axis), as the Redis tier stores them."""
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(p, d, generator=g).to(dtype), "values": torch.randn(p, d, generator=g).to(dtype)}


def stacked(*pages) -> dict[str, torch.Tensor]:
    return {name: torch.stack([page[name] for page in pages]) for name in pages[0]}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[f].dtype == b[f].dtype and torch.equal(a[f].view(torch.uint8), b[f].view(torch.uint8)) for f in a
    )


PAGE_BYTES = 2 * 16 * 8 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_tensor_codec_is_bit_exact(dtype):
    t = (torch.randn(2, 5, 3) * 100).to(dtype)
    if dtype.is_floating_point:
        t[0, 0, 0] = float("nan")
        t[0, 0, 1] = float("-inf")
    header, data = encode_tensors({"t": t, "empty": torch.empty(0, 4, dtype=dtype)}, meta={"layer": 3})
    out, meta = decode_tensors(header, data)
    assert meta == {"layer": 3}
    assert out["t"].dtype == dtype and out["t"].shape == t.shape
    assert torch.equal(out["t"].view(torch.uint8), t.view(torch.uint8))
    assert out["empty"].shape == (0, 4)


def test_codec_rejects_unknown_dtype_and_short_data():
    header, data = encode_tensors({"t": torch.ones(4)})
    with pytest.raises(ValueError):
        decode_tensors(header.replace(b"float32", b"object"), data)
    with pytest.raises(ValueError):
        decode_tensors(header, data[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_redis_chunk_round_trip_bit_exact(redis_tier, dtype):
    page = make_page(1, dtype)
    assert redis_tier.put_pages("s1", {"c1": page, "c2": make_page(2, dtype)})
    back = redis_tier.get_pages("s1", ["c2", "nope", "c1"])
    assert back[1] is None and same(back[0], make_page(2, dtype)) and same(back[2], page)
    assert redis_tier.stats.entries == 2 and redis_tier.stats.bytes > 0
    assert redis_tier.stats.bytes_read == redis_tier.stats.bytes_written == redis_tier.stats.bytes


def test_redis_keys_are_namespaced_with_ttl(redis_tier, redis_url):
    redis_tier.put_pages("s1", {"c1": make_page(2), "c2": make_page(3)})
    client = redis.Redis.from_url(redis_url)
    keys = sorted(k.decode() for k in client.scan_iter(match=f"{redis_tier.ns}:session:*"))
    # One hash tag per session (one cluster slot), and a manifest naming every KV key written and its writer.
    head = f"{redis_tier.ns}:session:{{s1}}"
    assert keys == [f"{head}:kv:c1", f"{head}:kv:c2", f"{head}:names"]
    assert client.hgetall(f"{head}:names") == {b"c1": redis_tier.writer.encode(), b"c2": redis_tier.writer.encode()}
    # KV outlives the record naming it (a record's TTL is ``ttl_s``).
    assert all(redis_tier.ttl_s < client.ttl(k) <= redis_tier.kv_ttl_s for k in keys)
    # The writer lives, and has logged the session it writes for.
    assert 0 < client.ttl(f"{redis_tier.ns}:writer:{redis_tier.writer}") <= WRITER_TTL_S
    assert client.zrange(f"{redis_tier.ns}:writing", 0, -1) == [f"{redis_tier.writer}|s1".encode()]
    redis_tier.delete_session("s1")
    assert list(client.scan_iter(match=f"{redis_tier.ns}:session:*")) == []
    assert client.zrange(f"{redis_tier.ns}:writing", 0, -1) == []
    assert redis_tier.stats.bytes == 0


def test_host_bound_holds_and_spill_promote_keeps_every_byte(redis_tier):
    pages = {f"c{i}": make_page(i) for i in range(10)}
    host = HostTier(capacity_bytes=3 * PAGE_BYTES, redis=redis_tier)
    for cid, page in pages.items():
        assert host.put_many("s2", [cid], stacked(page)) == PAGE_BYTES
        assert host.stats.bytes <= host.capacity_bytes
    assert host.stats.entries == 3 and host.stats.spills == 7
    assert {host.where("s2", cid) for cid in pages} == {"host", "redis"}
    for cid, page in pages.items():  # reading spilled pages promotes them back, spilling others
        got, from_redis = host.read_many("s2", [cid])
        assert same({k: t[0] for k, t in got.items()}, page)
        assert host.stats.bytes <= host.capacity_bytes
    assert host.stats.promotions >= 7
    host.free_many("s2", list(pages))
    assert host.stats.entries == 0 and host.stats.bytes == 0


def test_a_spill_checks_that_redis_still_holds_a_page_before_dropping_its_host_copy(redis_tier, redis_url):
    """A page read back from Redis is in the host tier and believed in Redis; if its key went (expired,
    or Redis restarted empty), spilling it again must write it, not drop the last copy."""
    pages = {f"c{i}": make_page(200 + i) for i in range(3)}
    host = HostTier(capacity_bytes=2 * PAGE_BYTES, redis=redis_tier)
    for cid, page in pages.items():
        host.put_many("s2", [cid], stacked(page))
    assert host.where("s2", "c0") == "redis"
    host.read_many("s2", ["c0"])  # back in a slot (c1 spilled for it), still believed in Redis
    assert host.where("s2", "c0") == "host" and host.copies.holds("s2", "c0")
    redis.Redis.from_url(redis_url).delete(redis_tier.chunk_key("s2", "c0"))
    host.read_many("s2", ["c1"])  # c0, least recently used, spills to make room
    host.read_many("s2", ["c2"])
    assert host.where("s2", "c0") == "redis"
    got, from_redis = host.read_many("s2", ["c0"])
    assert from_redis == PAGE_BYTES and same({k: t[0] for k, t in got.items()}, pages["c0"])


def test_a_read_larger_than_the_host_tier_returns_every_page_intact(redis_tier):
    """One read of more pages than the pool holds: each page comes back as written, whatever the
    read spills and promotes on the way (no view of a reused slot)."""
    pages = {f"c{i}": make_page(100 + i) for i in range(12)}
    host = HostTier(capacity_bytes=4 * PAGE_BYTES, redis=redis_tier)
    host.put_many("s2", list(pages), stacked(*pages.values()))
    assert host.stats.bytes <= host.capacity_bytes and host.stats.spills >= 8
    order = ["c3", "c11", "c0", "c7", "c1", "c10", "c2", "c9", "c4", "c8", "c5", "c6", "c3"]
    got, from_redis = host.read_many("s2", order)
    assert from_redis > 0
    for i, cid in enumerate(order):
        assert same({k: t[i] for k, t in got.items()}, pages[cid]), cid
    host.free_many("s2", list(pages))


def test_redis_down_host_keeps_its_bound_and_every_page_it_took():
    dead = RedisTier(RedisClient(DEAD_URL, timeout_s=0.3), namespace="rkvtest-dead")
    try:
        assert dead.put_pages("s", {"c": make_page(3)}) is False
        assert dead.healthy is False and dead.stats.errors >= 1 and dead.last_error
        host = HostTier(capacity_bytes=2 * PAGE_BYTES, redis=dead)
        for i in range(2):
            host.put_many("s", [f"c{i}"], stacked(make_page(i)))
        # Nothing can spill: a page past the bound is refused, whole, and the tier stays within it.
        with pytest.raises(HostFull, match="Redis is unavailable"):
            host.put_many("s", ["c2", "c3"], stacked(make_page(2), make_page(3)))
        assert host.stats.bytes == 2 * PAGE_BYTES and host.exhausted == 1
        assert [host.where("s", f"c{i}") for i in range(4)] == ["host", "host", "none", "none"]
        got, _ = host.read_many("s", ["c0", "c1"])
        assert all(same({k: t[i] for k, t in got.items()}, make_page(i)) for i in range(2))
    finally:
        dead.close()


def test_without_redis_a_store_past_the_bound_is_refused_and_reservations_hold_room():
    host = HostTier(capacity_bytes=4 * PAGE_BYTES, page_bytes=PAGE_BYTES)
    assert host.max_slots == 4 and host.reserve("a", 3)
    assert not host.reserve("b", 2) and host.refused == 1  # only one slot is not held for "a"
    with pytest.raises(HostFull, match="no Redis"):
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
    assert host.drop_session("a") == 3 and host.session_bytes("a") == 0 and host.stats.bytes == PAGE_BYTES


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
    assert host.drop_session("a") == 3 and host.reserved_bytes() == 0  # a dropped session holds nothing


def test_host_tier_calls_run_one_at_a_time():
    """The page reader demotes one session's pages while the model thread reads another's: a call waits
    while another holds the tier, then completes intact."""
    host = HostTier(capacity_bytes=8 * PAGE_BYTES)
    host.put_many("a", ["p0"], stacked(make_page(0)))
    done = threading.Event()

    def store_b():
        host.put_many("b", ["p0"], stacked(make_page(1)))
        done.set()

    with host._lock:  # another call in progress
        worker = threading.Thread(target=store_b)
        worker.start()
        assert not done.wait(0.3)
    worker.join(5)
    assert done.is_set()
    for sid, seed in (("a", 0), ("b", 1)):
        got, _ = host.read_many(sid, ["p0"])
        assert same(got, stacked(make_page(seed)))


def test_a_dead_writer_s_unnamed_keys_are_swept_and_what_another_took_over_is_kept(redis_tier, redis_url):
    client = redis.Redis.from_url(redis_url)
    ns = redis_tier.ns
    live = RedisTier(RedisClient(redis_url), namespace=ns, ttl_s=600)
    try:
        assert redis_tier.put_pages("s1", {"a": make_page(1), "b": make_page(2), "c": make_page(3)})
        assert live.own("s1", ["b"])  # a restore adopting the dead one's page takes it over
        assert live.dead_writings() == []  # the writer lives
        client.delete(f"{ns}:writer:{redis_tier.writer}")  # its liveness lapses (a killed process)
        assert live.dead_writings() == [(redis_tier.writer, "s1")]
        assert live.sweep_writer("s1", redis_tier.writer, {"c"}) == 1  # c: its record names it; b: live's
        head = f"{ns}:session:{{s1}}"
        assert sorted(k.decode() for k in client.scan_iter(match=f"{head}:kv:*")) == [f"{head}:kv:b", f"{head}:kv:c"]
        assert client.hget(f"{head}:names", "b") == live.writer.encode() and not client.hexists(f"{head}:names", "a")
        assert live.dead_writings() == [] and f"{redis_tier.writer}|s1".encode() not in client.zrange(f"{ns}:writing", 0, -1)
        # A live writer taken for dead (its liveness lapsed, its entries swept) logs its sessions again.
        client.delete(f"{ns}:writer:{live.writer}")
        client.zrem(f"{ns}:writing", f"{live.writer}|s1")
        assert live.keep_alive()
        assert live.put_pages("s1", {"d": make_page(4)})
        assert f"{live.writer}|s1".encode() in client.zrange(f"{ns}:writing", 0, -1)
    finally:
        live.delete_session("s1")
        client.delete(f"{ns}:writing", f"{ns}:writer:{live.writer}", f"{ns}:writer:{redis_tier.writer}")
        live.close()
