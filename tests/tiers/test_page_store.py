"""The page store on a real Redis: items as fields of one hash per group, bit-exact, written pending (a
TTL no record has extended yet), renewed without ever shortening a longer life, deleted by item or group."""
import secrets

import pytest
import redis
import torch

from tiers.store.redis.client import RedisClient
from tiers.store.redis.keys import kv_key
from tiers.store.redis.pages import RedisPageStore
from tiers.store.wire import pack, unpack


@pytest.fixture
def store(redis_url):
    ns = f"rkvtest-{secrets.token_hex(4)}"
    s = RedisPageStore(RedisClient(redis_url), namespace=ns, pending_ttl_s=60)
    yield s
    raw = redis.Redis.from_url(redis_url)
    for key in raw.scan_iter(match=f"{ns}:*"):
        raw.delete(key)
    s.close()


def page(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(4, 8, generator=g).to(dtype), "values": torch.randn(4, 8, generator=g).to(dtype)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[f].dtype == b[f].dtype and torch.equal(a[f].view(torch.uint8), b[f].view(torch.uint8)) for f in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.int8])
def test_the_wire_format_is_bit_exact(dtype):
    t = (torch.randn(2, 5, 3) * 100).to(dtype)
    if dtype.is_floating_point:
        t[0, 0, 0], t[0, 0, 1] = float("nan"), float("-inf")
    out = unpack(pack({"t": t, "empty": torch.empty(0, 4, dtype=dtype)}))
    assert torch.equal(out["t"].view(torch.uint8), t.view(torch.uint8)) and out["empty"].shape == (0, 4)


def test_the_wire_format_refuses_unknown_dtypes_and_short_values():
    value = pack({"t": torch.ones(4)})
    with pytest.raises(ValueError):
        unpack(value.replace(b"float32", b"object0"))
    with pytest.raises(ValueError):
        unpack(value[:-1])


def test_items_round_trip_by_group_and_a_group_is_one_key(store, redis_url):
    items = {"p1/0.0": page(0), "p1/1.0": page(1, torch.bfloat16), "p2/0.0": page(2)}
    assert store.put("s", items)
    got = store.get("s", ["p2/0.0", "p1/1.0", "p1/9.9", "p1/0.0"])
    assert got[2] is None and all(same(g, items[n]) for g, n in zip([got[0], got[1], got[3]],
                                                                      ["p2/0.0", "p1/1.0", "p1/0.0"]))
    assert store.has("s", ["p1/0.0", "p1/9.9"]) == [True, False]
    assert store.sizes("s", ["p1", "p2", "p3"]) == [2, 1, 0]
    raw = redis.Redis.from_url(redis_url)
    assert raw.type(kv_key(store.ns, "s", "p1")) == b"hash"
    assert store.session_bytes("s") == sum(len(pack(t)) for t in items.values())


def test_a_group_is_written_pending_and_a_renewal_never_shortens_a_longer_life(store, redis_url):
    raw = redis.Redis.from_url(redis_url)
    store.put("s", {"p1/0.0": page(0)})
    key = kv_key(store.ns, "s", "p1")
    assert 0 < raw.ttl(key) <= 60
    raw.expire(key, 5000)  # a commit named it: it lives as long as its record
    store.put("s", {"p1/0.1": page(1)})  # a write into it keeps that life
    assert raw.ttl(key) > 4000
    assert store.renew("s", ["p1"]) and raw.ttl(key) > 4000
    raw.expire(key, 10)
    assert store.renew("s", ["p1"]) and raw.ttl(key) > 50  # a pending group gets the short TTL again


def test_items_and_whole_groups_are_deleted(store):
    store.put("s", {"p1/0.0": page(0), "p1/0.1": page(1), "p2/0.0": page(2)})
    assert store.delete("s", ["p1/0.0", "p2"])
    assert store.has("s", ["p1/0.0", "p1/0.1", "p2/0.0"]) == [False, True, False]
    assert store.session_bytes("s") == len(pack(page(1)))
    store.forget("s")
    assert store.session_bytes("s") == 0


def test_a_dead_store_fails_soft(redis_url):
    dead = RedisPageStore(RedisClient("redis://127.0.0.1:1/0", timeout_s=0.2), namespace="x")
    try:
        assert not dead.put("s", {"p1/0.0": page(0)})
        assert dead.get("s", ["p1/0.0"]) == [None] and dead.has("s", ["p1/0.0"]) is None
        assert dead.sizes("s", ["p1"]) is None and not dead.renew("s", ["p1"]) and dead.stats.errors >= 4
        assert dead.unavailable("s")
    finally:
        dead.close()


def test_a_large_put_goes_in_bounded_round_trips_and_every_group_gets_its_ttl(store, redis_url, monkeypatch):
    from tiers.store.redis import pages

    monkeypatch.setattr(pages, "PUT_BYTES", 3 * len(pack(page(0))))
    monkeypatch.setattr(pages, "PUT_FIELDS", 2)
    items = {f"p{g}/0.{k}": page(10 * g + k) for g in range(2) for k in range(5)}
    calls = store.client.calls
    assert store.put("s", items)
    assert store.client.calls - calls >= 4  # ten items, at most three a round trip
    assert store.sizes("s", ["p0", "p1"]) == [5, 5]
    assert all(same(g, items[n]) for g, n in zip(store.get("s", list(items)), items))
    raw = redis.Redis.from_url(redis_url)
    assert all(0 < raw.ttl(kv_key(store.ns, "s", f"p{g}")) <= 60 for g in range(2))
