"""The memory map (``rocketkv_mt.cache.memory_map``) against the cache's own state: a ``tiered`` cache
whose host tier spills to Redis (all three tiers in use), the permanent-eviction and keep-all modes,
and the run-length wire form."""
import secrets

import pytest
import redis
import torch

from cache_drive import SPEC, three_turns
from rocketkv_mt.cache import TierContext, TierPolicy, make_cache
from rocketkv_mt.cache.memory_map import (
    DEVICE,
    EVICTED,
    HOST,
    REDIS,
    STATES,
    UNFED,
    parked_map,
    parked_summary,
    ranges,
    runs,
)
from rocketkv_mt.config import RocketKVConfig
from tiers.host.tier import HostTier
from tiers.store.redis.client import RedisClient
from tiers.store.redis.pages import RedisPageStore

ROCKET = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)
PAGE_BYTES = 8 * SPEC.head_dim * 2 * 4  # one raw float32 page: 8 tokens of one KV head, keys and values


def decode_row(row: dict, n: int) -> torch.Tensor:
    """A row's runs back to one state code per position."""
    pairs = list(zip(row["runs"][::2], row["runs"][1::2]))
    out = torch.cat([torch.full((length,), state, dtype=torch.uint8) for state, length in pairs])
    assert out.numel() == n
    return out


def decode_ranges(flat: list[int], n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for start, length in zip(flat[::2], flat[1::2]):
        assert length > 0
        mask[start : start + length] = True
    return mask


@pytest.fixture
def page_store(redis_url):
    store = RedisPageStore(RedisClient(redis_url), namespace=f"rkvtest-map-{secrets.token_hex(3)}")
    yield store
    raw = redis.Redis.from_url(redis_url)
    for key in raw.scan_iter(match=f"{store.ns}:*"):
        raw.delete(key)
    store.close()


def test_a_tiered_map_matches_the_cache_in_all_three_tiers(page_store, monkeypatch):
    # 40 host pages for about 150 cold pages: most cold pages spill to Redis.
    host = HostTier(40 * PAGE_BYTES, page_store)
    tiers = TierContext(host, "map-tiered", TierPolicy(page_tokens=8, read_whole=0))
    cache = make_cache("tiered", SPEC, ROCKET, tiers=tiers)
    three_turns(cache, seed=3)

    def moved(*args, **kwargs):
        raise AssertionError("the memory map read, wrote or renewed a page: it is bookkeeping only")

    # From here on no page may move or be read, in the host tier or in Redis, nor Redis be asked anything.
    for name in ("read_many", "put_many", "free_many", "unstored", "stored", "renew_pending"):
        monkeypatch.setattr(host, name, moved)
    for name in ("get", "put", "has", "sizes", "renew", "delete", "session_bytes"):
        monkeypatch.setattr(page_store, name, moved)
    for name in ("run", "call"):
        monkeypatch.setattr(page_store.client, name, moved)
    monkeypatch.setattr(page_store, "_redis", None)
    extra = 5  # a conversation longer than what was fed: the next turn's message
    mm = cache.memory_map(cache.history_len + extra)
    n = cache.history_len + extra
    assert mm.states.shape == (SPEC.num_layers, SPEC.num_kv_heads, n)
    for layer, store in enumerate(cache.layers):
        cold = cache.prefill.cold[layer]
        for head in range(SPEC.num_kv_heads):
            row = mm.states[layer, head]
            assert torch.equal(torch.nonzero(row == DEVICE).flatten(), store.positions[head].sort().values)
            in_host, in_redis = [], []
            for page, pid in enumerate(cold.ids[head]):
                alive = cold._alive.buf[head, page]
                where = host.where_many("map-tiered", [pid])[0]
                (in_host if where == "host" else in_redis).append(cold._pos.buf[head, page][alive])
            assert torch.equal(torch.nonzero(row == HOST).flatten(), torch.cat(in_host).sort().values)
            assert torch.equal(torch.nonzero(row == REDIS).flatten(), torch.cat(in_redis).sort().values)
            assert bool((row[cache.history_len :] == UNFED).all()) and not bool((row == EVICTED).any())
    summary = mm.summary()
    assert cache.map_summary(n) == summary  # counted without the map, the same figures
    assert summary["device"] > 0 and summary["host"] > 0 and summary["redis"] > 0
    assert summary["device"] + summary["host"] + summary["redis"] + summary["unfed"] == mm.states.numel()
    # The last turn's re-admissions are the cache's own count of promoted slots, and all on the device.
    assert summary["readmitted"] == cache.readmitted > 0
    assert bool((mm.states[mm.readmitted] == DEVICE).all())
    assert summary["demoted"] > 0 and not bool((mm.states[mm.demoted] == DEVICE).any())


def test_the_wire_form_round_trips_and_a_new_turn_forgets_the_last_ones_moves():
    tiers = TierContext(HostTier(64 << 20, None), "map-wire", TierPolicy(page_tokens=8, read_whole=0))
    cache = make_cache("tiered", SPEC, ROCKET, tiers=tiers)
    three_turns(cache, seed=4)
    mm = cache.memory_map(cache.history_len)
    wire = mm.encode()
    assert wire["states"] == list(STATES) and wire["fed"] == cache.history_len
    assert len(wire["rows"]) == SPEC.num_layers * SPEC.num_kv_heads
    for row in wire["rows"]:
        states = mm.states[row["layer"], row["head"]]
        assert torch.equal(decode_row(row, states.numel()), states)
        assert torch.equal(decode_ranges(row["readmitted"], states.numel()), mm.readmitted[row["layer"], row["head"]])
        assert torch.equal(decode_ranges(row["demoted"], states.numel()), mm.demoted[row["layer"], row["head"]])
    assert wire["summary"] == mm.summary()
    cache.begin_forward(1, prefill=True, max_new=1)  # a new turn begins: nothing moved by it yet
    after = cache.memory_map(cache.history_len)
    assert after.summary()["readmitted"] == 0 and after.summary()["demoted"] == 0
    assert cache.map_summary(cache.history_len) == after.summary()
    cache.release()


@pytest.mark.parametrize("mode, kept_all", [("snapkv", False), ("rocketkv", False), ("full", True),
                                            ("rocketkv-mt", True)])
def test_modes_without_cold_tiers_are_device_and_evicted(mode, kept_all):
    cache = make_cache(mode, SPEC, ROCKET)
    three_turns(cache, seed=5)
    summary = cache.memory_map(cache.history_len + 2).summary()
    assert cache.map_summary(cache.history_len + 2) == summary
    slots = SPEC.num_layers * SPEC.num_kv_heads
    assert summary["unfed"] == 2 * slots
    assert summary["host"] == summary["redis"] == summary["readmitted"] == summary["demoted"] == 0
    assert summary["device"] == sum(store.length for store in cache.layers) * SPEC.num_kv_heads
    assert summary["evicted"] == (0 if kept_all else slots * cache.history_len - summary["device"])
    assert summary["positions"] == cache.history_len + 2
    assert kept_all or summary["evicted"] > 0


def test_runs_and_ranges():
    assert runs(torch.tensor([0, 0, 1, 1, 1, 0], dtype=torch.uint8)) == [0, 2, 1, 3, 0, 1]
    assert runs(torch.tensor([], dtype=torch.uint8)) == []
    assert ranges(torch.tensor([True, False, True, True, False, True])) == [0, 1, 2, 2, 5, 1]
    assert ranges(torch.zeros(4, dtype=torch.bool)) == []


def test_a_parked_sessions_summary_is_its_maps():
    for in_redis in (True, False):
        assert parked_summary(3, 2, 10, 14, in_redis) == parked_map(3, 2, 10, 14, in_redis).summary()
    assert parked_summary(3, 2, 10, 14, True)["redis"] == 60 and parked_summary(3, 2, 10, 14, False)["unfed"] == 84
