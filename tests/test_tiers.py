"""Tiers against the real Redis: bit-exact round trips, the host bound, spills, and Redis outages."""
import secrets

import pytest
import torch

from tiers.base import Chunk
from tiers.host import HostTier
from tiers.redis_tier import RedisTier, decode_tensors, encode_tensors

REDIS_URL = "redis://127.0.0.1:6379/0"
DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: every call fails fast


@pytest.fixture
def redis_tier():
    tier = RedisTier(REDIS_URL, namespace=f"rkvtest-{secrets.token_hex(4)}", ttl_s=600)
    if not tier.ping():
        pytest.fail(f"Redis must be running at {REDIS_URL} (.ci/run starts it)")
    yield tier
    tier.delete_session("s1")
    tier.delete_session("s2")
    tier.close()


def make_chunk(seed: int, dtype=torch.float32, hkv=3, c=16, d=8) -> Chunk:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, c, d, generator=g).to(dtype)
    v = torch.randn(hkv, c, d, generator=g).to(dtype)
    return Chunk(k, v, torch.arange(seed * c, seed * c + c).expand(hkv, c).clone())


def same(a: Chunk, b: Chunk) -> bool:
    return all(
        getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8))
        for f in ("keys", "values", "positions")
    )


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
    chunk = make_chunk(1, dtype)
    assert redis_tier.put_chunk("s1", "c1", chunk)
    back = redis_tier.get_chunk("s1", "c1")
    assert back is not None and same(back, chunk)
    assert redis_tier.stats.entries == 1 and redis_tier.stats.bytes > 0


def test_redis_keys_are_namespaced_with_ttl(redis_tier):
    import redis

    redis_tier.put_chunk("s1", "c1", make_chunk(2))
    redis_tier.put_meta("s1", {"messages": []})
    client = redis.Redis.from_url(REDIS_URL)
    keys = sorted(k.decode() for k in client.scan_iter(match=f"{redis_tier.ns}:*"))
    assert keys == [f"{redis_tier.ns}:session:s1:kv:c1", f"{redis_tier.ns}:session:s1:meta"]
    assert all(0 < client.ttl(k) <= 600 for k in keys)
    redis_tier.delete_session("s1")
    assert list(client.scan_iter(match=f"{redis_tier.ns}:*")) == []
    assert redis_tier.stats.bytes == 0


def test_host_bound_holds_and_spill_promote_keeps_every_byte(redis_tier):
    chunks = {f"c{i}": make_chunk(i) for i in range(10)}
    host = HostTier(capacity_bytes=3 * chunks["c0"].nbytes(), redis=redis_tier)
    for cid, chunk in chunks.items():
        host.put(("s2", cid), chunk)
        assert host.stats.bytes <= host.capacity_bytes
    assert host.stats.entries == 3 and host.stats.spills == 7 and host.overflow_slots == 0
    assert {host.where(("s2", cid)) for cid in chunks} == {"host", "redis"}
    for cid, chunk in chunks.items():  # reading spilled chunks promotes them back, spilling others
        assert same(host.get(("s2", cid)), chunk)
        assert host.stats.bytes <= host.capacity_bytes
    assert host.stats.promotions >= 7
    for cid in chunks:
        host.free(("s2", cid))
    assert host.stats.entries == 0 and host.stats.bytes == 0


def test_redis_down_host_keeps_working_and_reports():
    dead = RedisTier(DEAD_URL, namespace="rkvtest-dead", timeout_s=0.3)
    try:
        chunk = make_chunk(3)
        assert dead.put_chunk("s", "c", chunk) is False
        assert dead.healthy is False and dead.stats.errors >= 1 and dead.last_error
        host = HostTier(capacity_bytes=2 * chunk.nbytes(), redis=dead)
        for i in range(4):
            host.put(("s", f"c{i}"), make_chunk(i))
        # Nothing could spill: the host tier goes over its bound rather than lose a token.
        assert host.overflow_slots == 2
        assert all(same(host.get(("s", f"c{i}")), make_chunk(i)) for i in range(4))
    finally:
        dead.close()
