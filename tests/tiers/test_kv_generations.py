"""A session's KV in Redis is fenced by the generation its record commits (``tiers.session_kv``): a save
that loses its compare-and-set, a record write that fails after the KV was written, and a persist that
fails half way each leave a restore in a new process the committed state (or a clean refusal), never a
mix; what they wrote is removed; KV outlives its record's TTL period while saves go on.

Each "process" is a host tier of its own on one private Redis; the caches are fed random attention
inputs (``cache_drive``); a record's commit is ``SessionKV.committed``, a lost one ``abandoned``."""
from __future__ import annotations

import json
import secrets
import time

import pytest
import torch
from cache_drive import SPEC, forward, layer_inputs
from serving_helpers import RedisServer

from rocketkv_mt.cache import TierContext, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.cold_layer import page_names
from tiers.host import HostTier
from tiers.keys import kv_key, manifest_key, session_pattern
from tiers.redis_client import RedisClient
from tiers.redis_tier import RedisTier
from tiers.session_kv import KVNotWritten, table_names

POLICY = TierPolicy(page_tokens=8)
ROCKET = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)
SID = "s_gen"


class Process:
    """One replica's tiers: its own host tier, on the shared Redis."""

    def __init__(self, url: str, ns: str, ttl_s: int = 600, host_bytes: int = 64 << 20):
        self.redis = RedisTier(RedisClient(url), ns, ttl_s)
        self.host = HostTier(host_bytes, self.redis)

    def context(self) -> TierContext:
        return TierContext(self.host, SID, POLICY)

    def cache(self):
        return make_cache("tiered", SPEC, ROCKET, tiers=self.context())

    def restored(self, ref: dict):
        """A new cache restored from ``ref`` (through JSON, as a record carries it), or None if refused."""
        cache = self.cache()
        return cache if cache.restore(json.loads(json.dumps(ref))) else None



@pytest.fixture
def ns():
    return f"rkvgen-{secrets.token_hex(3)}"


@torch.inference_mode()
def turn(cache, seed: int, n_new: int = 40, max_new: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    forward(cache, layer_inputs(gen, n_new), prefill=True, max_new=max_new)
    for _ in range(max_new):
        forward(cache, layer_inputs(gen, 1), prefill=False)
    cache.end_turn()


def state(cache) -> list[torch.Tensor]:
    """What a restore must give back: each layer's primary set (positions, keys) and cold positions."""
    out = []
    for store, cold in zip(cache.layers, cache.prefill.cold):
        out += [store.positions.cpu().clone(), store.keys.cpu().clone()]
        out += [pos.sort().values.clone() for pos in cold.held_per_head()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def stored_keys(server: RedisServer, ns: str) -> set[str]:
    return {k.decode() for k in server.client().scan_iter(match=session_pattern(ns), count=1000)}


def named_keys(server: RedisServer, ns: str, ref: dict) -> set[str]:
    """The keys a record's generation names: its tables and the pages its page tables list, and the manifest."""
    from tiers.redis_tier import decode_tensors

    client, names = server.client(), set(table_names(ref["gen"], ref["layers"]))
    for layer in range(ref["layers"]):
        header, data = client.hmget(kv_key(ns, SID, f"{ref['gen']}.index-l{layer}"), ["header", "data"])
        names |= set(page_names(layer, decode_tensors(header, data)[0]))
    return {kv_key(ns, SID, n) for n in names} | {manifest_key(ns, SID)}


def committed_once(server: RedisServer, ns: str, ttl_s: int = 600):
    """A process whose cache took a long first turn and committed it: (process, cache, its reference)."""
    a = Process(server.url, ns, ttl_s)
    cache = a.cache()
    turn(cache, 1, n_new=120)
    ref = cache.persist()
    a.context().kv.committed(ref)
    return a, cache, ref


def test_a_save_that_lost_its_cas_leaves_the_winner_restorable_and_nothing_of_its_own(private_redis, ns):
    a = Process(private_redis.url, ns)
    first = a.cache()
    turn(first, 1, n_new=120)
    v1 = first.persist()
    a.context().kv.committed(v1)
    # Another replica takes the session over from v1 and commits v2.
    b = Process(private_redis.url, ns)
    taken = b.restored(v1)
    assert taken is not None and same(state(taken), state(first))
    turn(taken, 2)
    v2 = taken.persist()
    b.context().kv.committed(v2)
    winner = state(taken)
    # The stale copy goes on: a turn, a persist, and a compare-and-set that fails.
    turn(first, 3)
    v3 = first.persist()
    assert v3["gen"] != v2["gen"]
    a.context().kv.abandoned(v3)
    restored = Process(private_redis.url, ns).restored(v2)
    assert restored is not None and same(state(restored), winner)  # the winner's KV, not a mix
    assert Process(private_redis.url, ns).restored(v3) is None  # the loser's generation is gone
    a.host.drop_session(SID)  # the stale copy leaves: what only it wrote goes with it
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)


def test_a_record_write_that_failed_after_persist_keeps_the_committed_state(private_redis, ns):
    a, cache, v1 = committed_once(private_redis, ns)
    at_v1 = state(cache)
    turn(cache, 2)
    lost = cache.persist()
    a.context().kv.abandoned(lost)  # the record write failed: v1 is still the record
    elsewhere = Process(private_redis.url, ns).restored(v1)
    assert elsewhere is not None and same(state(elsewhere), at_v1)
    # The next save (the record retried) commits; then exactly that generation is left.
    turn(cache, 3)
    v2 = cache.persist()
    a.context().kv.committed(v2)
    again = Process(private_redis.url, ns).restored(v2)
    assert again is not None and same(state(again), state(cache))
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)


def tables_in(server: RedisServer, ns: str) -> set[str]:
    return {k.rsplit(":", 1)[1] for k in stored_keys(server, ns) if ".index-l" in k or ".primary-l" in k}


@pytest.mark.parametrize("fail_at", range(SPEC.num_layers + 1))  # each layer's pages, then the tables
def test_a_persist_that_fails_half_way_removes_its_generation(private_redis, ns, monkeypatch, fail_at):
    a, cache, v1 = committed_once(private_redis, ns)
    at_v1 = state(cache)
    turn(cache, 2, n_new=60)  # new cold pages in every layer
    original, calls = RedisTier.put_pages, []

    def failing(self, sid, pages):
        calls.append(sid)
        return False if len(calls) - 1 == fail_at else original(self, sid, pages)

    monkeypatch.setattr(RedisTier, "put_pages", failing)
    with pytest.raises(KVNotWritten):
        cache.persist()
    assert len(calls) == fail_at + 1
    monkeypatch.setattr(RedisTier, "put_pages", original)
    assert tables_in(private_redis, ns) == set(table_names(v1["gen"], v1["layers"]))  # no part of a second one
    elsewhere = Process(private_redis.url, ns).restored(v1)
    assert elsewhere is not None and same(state(elsewhere), at_v1)
    # The next persist writes whole, and its commit leaves exactly its generation.
    v2 = cache.persist()
    a.context().kv.committed(v2)
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)


def test_a_page_table_that_does_not_match_its_record_is_refused_whole(private_redis, ns):
    a, cache, v1 = committed_once(private_redis, ns)
    assert Process(private_redis.url, ns).restored({**v1, "history_len": v1["history_len"] + 1}) is None
    assert Process(private_redis.url, ns).restored({**v1, "layers": v1["layers"] - 1}) is None
    assert Process(private_redis.url, ns).restored({**v1, "gen": "../x"}) is None
    # A page of the generation gone: refused, and the refusing process took nothing on.
    client = private_redis.client()
    page = next(n.decode() for n in client.hkeys(manifest_key(ns, SID)) if n.decode().startswith("l"))
    client.delete(kv_key(ns, SID, page))
    other = Process(private_redis.url, ns)
    assert other.restored(v1) is None
    assert other.host.kept(SID) == (set(), {})


def test_a_session_whose_record_outlives_one_ttl_restores_its_kv(private_redis, ns):
    """A 4 s record TTL (KV: 5 s): saves every ~1.2 s for 7 s keep pages written at the start alive."""
    a, cache, ref = committed_once(private_redis, ns, ttl_s=4)
    first_pages = set(page_names(0, cache.prefill.cold[0].index_tensors()))
    start = time.monotonic()
    seed = 2
    while time.monotonic() - start < 7:
        time.sleep(1.2)
        turn(cache, seed, n_new=4, max_new=1)
        seed += 1
        ref = cache.persist()
        a.context().kv.committed(ref)
    assert first_pages & set(page_names(0, cache.prefill.cold[0].index_tensors())), "pages from the start are kept"
    restored = Process(private_redis.url, ns, ttl_s=4).restored(ref)
    assert restored is not None and same(state(restored), state(cache))
    client = private_redis.client()
    assert all(0 < client.ttl(k) <= 5 for k in stored_keys(private_redis, ns))
