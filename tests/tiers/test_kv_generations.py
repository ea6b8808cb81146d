"""A session's KV in Redis is fenced by the generation its record commits (``tiers.session_kv``): a
persist writes the pages the store lacks and the generation's own tables (group ``g<gen>``) in one
round trip, all pending; the record's commit (``app.session_store``) makes the groups it names live as
long as the record and deletes those the record before named and it does not. A save that loses its
compare-and-set, a record write that fails after the KV was written, and a persist that fails half way
each leave a restore in a new process the committed state (or a clean refusal), never a mix; what they
wrote is removed, or left pending for its holder; a group the store lost fails the commit and is written
again; a record without KV leaves what the one before named pending for its holder; KV outlives its
record's TTL period while saves go on; a session's keys stay few: a group per turn that demoted, its
generation's tables, and the record.

Each "process" is a host tier, page store and record store of its own on one private Redis; the caches
are fed random attention inputs (``cache_drive``); a record's commit is ``SessionStore.save`` followed by
``SessionKV.committed`` (a lost one: ``abandoned``), as ``app.session_repository`` does."""
from __future__ import annotations

import asyncio
import json
import secrets
import time

import pytest
import torch
from cache_drive import SPEC, forward, layer_inputs
from serving_helpers import RedisServer

from app.session_store import KV_MISSING, MOVED, SAVED, SessionStore, new_tag
from rocketkv_mt.cache import TierContext, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.cold.ids import page_names
from tiers.host.tier import HostTier
from tiers.session_kv import KVNotWritten, table_names
from tiers.store.protocol import group_of
from tiers.store.redis.client import RedisClient
from tiers.store.redis.keys import kv_key, kv_prefix, session_key, session_pattern
from tiers.store.redis.pages import RedisPageStore
from tiers.store.wire import unpack

POLICY = TierPolicy(page_tokens=8)
ROCKET = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)
SID = "s_gen"
PENDING_TTL_S = 60


class Process:
    """One replica's tiers and records: its own host tier, page store and record store, on the shared Redis.
    ``tag``/``lineage``: what it last committed or loaded (its next commit's fence)."""

    def __init__(self, url: str, ns: str, ttl_s: int = 1000, host_bytes: int = 64 << 20):
        self.client = RedisClient(url)
        self.store = RedisPageStore(self.client, ns, PENDING_TTL_S)
        self.host = HostTier(host_bytes, self.store)
        self.records = SessionStore(self.client, ns, ttl_s=ttl_s, pending_ttl_s=PENDING_TTL_S)
        self.tag: str | None = None
        self.lineage: list[str] = []

    def context(self) -> TierContext:
        return TierContext(self.host, SID, POLICY)

    def cache(self):
        return make_cache("tiered", SPEC, ROCKET, tiers=self.context())

    def restored(self, ref: dict):
        """A new cache restored from ``ref`` (through JSON, as a record carries it), or None if refused."""
        cache = self.cache()
        return cache if cache.restore(json.loads(json.dumps(ref))) else None

    def load(self):
        """The session as its record stands: a cache restored from the generation it names (or None), and
        the record's tag as this process's fence."""
        data, stored = asyncio.run(self.records.load(SID))
        self.tag, self.lineage = stored.tag, list(stored.lineage)
        return self.restored(data["kv"])

    def commit(self, ref: dict | None) -> str:
        """Save the record naming ``ref`` (None: no KV) by compare-and-set on this process's tag, and settle
        the generation as the repository does: committed, or abandoned. The save's outcome."""
        tag = new_tag()
        result = asyncio.run(self.records.save({"id": SID, "kv": ref}, {}, self.tag, tag, [*self.lineage, tag],
                                               None if ref is None else ref["groups"]))
        if result.outcome == SAVED:
            self.context().kv.committed(ref)
            self.tag, self.lineage = tag, [*self.lineage, tag]
        elif ref is not None:
            self.context().kv.abandoned(ref)
        return result.outcome

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def ns():
    return f"rkvgen-{secrets.token_hex(3)}"


@pytest.fixture
def spawn(private_redis, ns):
    """``spawn(**kwargs)``: a new ``Process`` on the private Redis, closed after the test."""
    made: list[Process] = []

    def new(**kwargs) -> Process:
        made.append(Process(private_redis.url, ns, **kwargs))
        return made[-1]

    yield new
    for process in made:
        process.close()


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


def groups_in(server: RedisServer, ns: str) -> set[str]:
    """The KV groups the session has in Redis."""
    prefix = kv_prefix(ns, SID)
    return {k.removeprefix(prefix) for k in stored_keys(server, ns) if k.startswith(prefix)}


def tables_in(server: RedisServer, ns: str) -> set[str]:
    """The generations whose tables are in Redis (their groups)."""
    return {g for g in groups_in(server, ns) if g.startswith("g")}


def named_keys(server: RedisServer, ns: str, ref: dict) -> set[str]:
    """The keys a record naming ``ref`` must leave, read from what Redis holds: the record, its generation's
    tables, and the groups of the pages those tables list."""
    client, groups = server.client(), {f"g{ref['gen']}"}
    for layer in range(ref["layers"]):
        tensors = unpack(client.hget(kv_key(ns, SID, f"g{ref['gen']}"), f"index{layer}"))
        groups |= {group_of(pid) for pid in page_names(layer, tensors)}
    return {kv_key(ns, SID, g) for g in groups} | {session_key(ns, SID)}


def ttls(server: RedisServer, ns: str, groups) -> list[int]:
    client = server.client()
    return [client.ttl(kv_key(ns, SID, g)) for g in groups]


def committed_once(spawn, ttl_s: int = 1000):
    """A process whose cache took a long first turn and committed it: (process, cache, its reference)."""
    a = spawn(ttl_s=ttl_s)
    cache = a.cache()
    turn(cache, 1, n_new=120)
    ref = cache.persist()
    assert a.commit(ref) == SAVED
    return a, cache, ref


def test_a_generation_is_written_pending_in_one_round_trip_and_its_commit_makes_it_live(private_redis, ns, spawn):
    a = spawn()
    cache = a.cache()
    turn(cache, 1, n_new=120)
    before = a.client.calls
    v1 = cache.persist()
    assert a.client.calls == before + 1  # the pages and the tables: one pipeline
    tables = f"g{v1['gen']}"
    assert v1["groups"][tables] == 2 * SPEC.num_layers and len(v1["groups"]) == 2  # one turn: one page group
    client = private_redis.client()
    assert [client.hlen(kv_key(ns, SID, g)) for g in v1["groups"]] == list(v1["groups"].values())
    assert all(0 < ttl <= PENDING_TTL_S for ttl in ttls(private_redis, ns, v1["groups"]))  # pending
    assert a.commit(v1) == SAVED
    assert all(ttl > PENDING_TTL_S for ttl in ttls(private_redis, ns, v1["groups"]))  # the record's life
    # The next generation writes only the new turn's pages (pages never change) beside its own tables,
    # again in one round trip; its commit deletes the tables of the one before, which it does not name.
    turn(cache, 2)
    put, written = a.store.put, []

    def recording(sid, items):
        written.extend(items)
        return put(sid, items)

    a.store.put = recording
    before = a.client.calls
    v2 = cache.persist()
    assert a.client.calls == before + 1
    first_pages = set(v1["groups"]) - {tables}
    assert written and not {group_of(n) for n in written} & first_pages and first_pages < set(v2["groups"])
    assert a.commit(v2) == SAVED
    assert tables_in(private_redis, ns) == {f"g{v2['gen']}"}
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)


def test_a_session_keeps_a_key_per_turn_that_demoted_one_for_its_generation_and_its_record(private_redis, ns, spawn):
    a, cache, ref = committed_once(spawn)
    turns = 1
    for seed in range(2, 7):
        turn(cache, seed)
        ref = cache.persist()
        assert a.commit(ref) == SAVED
        turns += 1
    pages = [pid for cold in cache.prefill.cold for pid in cold.page_ids()]
    page_groups = {group_of(pid) for pid in pages}
    keys = stored_keys(private_redis, ns)
    assert keys == {session_key(ns, SID), kv_key(ns, SID, f"g{ref['gen']}")} | {kv_key(ns, SID, g) for g in page_groups}
    assert len(page_groups) <= turns and len(keys) <= turns + 2 < len(pages) // 4
    # A turn's group holds every layer's pages of that turn.
    client = private_redis.client()
    fields = {f.decode().partition(".")[0] for g in page_groups for f in client.hkeys(kv_key(ns, SID, g))}
    assert fields == {str(layer) for layer in range(SPEC.num_layers)}


def test_a_save_that_lost_its_cas_leaves_the_winner_restorable_and_nothing_of_its_own(private_redis, ns, spawn):
    a, first, v1 = committed_once(spawn)
    # Another replica takes the session over from v1's record and commits v2.
    b = spawn()
    taken = b.load()
    assert taken is not None and same(state(taken), state(first))
    turn(taken, 2)
    v2 = taken.persist()
    assert b.commit(v2) == SAVED
    winner = state(taken)
    # The stale copy goes on: a turn, a persist, and a compare-and-set that fails.
    turn(first, 3)
    v3 = first.persist()
    assert v3["gen"] != v2["gen"]
    assert a.commit(v3) == MOVED
    assert tables_in(private_redis, ns) == {f"g{v2['gen']}"}  # the loser's tables went at once
    restored = spawn().load()
    assert restored is not None and same(state(restored), winner)  # the winner's KV, not a mix
    assert spawn().restored(v3) is None  # the loser's generation is gone
    # The loser's own new pages are named by no record: pending, they expire unless their holder renews them.
    own = set(v3["groups"]) - set(v1["groups"]) - {f"g{v3['gen']}"}
    assert own and own <= groups_in(private_redis, ns)
    assert all(0 < ttl <= PENDING_TTL_S for ttl in ttls(private_redis, ns, own))
    a.host.drop_session(SID)  # the stale copy leaves: what only it wrote goes with it
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)


def test_a_record_write_that_failed_after_persist_keeps_the_committed_state(private_redis, ns, spawn):
    a, cache, v1 = committed_once(spawn)
    at_v1 = state(cache)
    turn(cache, 2)
    lost = cache.persist()
    a.context().kv.abandoned(lost)  # the record write failed: v1 is still the record
    assert tables_in(private_redis, ns) == {f"g{v1['gen']}"}
    elsewhere = spawn().load()
    assert elsewhere is not None and same(state(elsewhere), at_v1)
    # The lost generation's new pages stay for the cache that holds them: pending, renewed by their holder.
    own = set(lost["groups"]) - set(v1["groups"]) - {f"g{lost['gen']}"}
    assert own and own <= groups_in(private_redis, ns)
    private_redis.client().expire(kv_key(ns, SID, next(iter(own))), 5)
    assert a.host.renew_pending() >= len(own)
    assert all(ttl > 5 for ttl in ttls(private_redis, ns, own))
    # The next save (the record retried) commits; then exactly that generation is left.
    turn(cache, 3)
    v2 = cache.persist()
    assert own <= set(v2["groups"]) and a.commit(v2) == SAVED
    again = spawn().load()
    assert again is not None and same(state(again), state(cache))
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)


@pytest.mark.parametrize("written", ["nothing", "pages", "everything"])  # what the failed write left in Redis
def test_a_persist_that_fails_half_way_removes_its_generation(private_redis, ns, spawn, monkeypatch, written):
    a, cache, v1 = committed_once(spawn)
    at_v1 = state(cache)
    turn(cache, 2, n_new=60)  # new cold pages in every layer
    original, calls = RedisPageStore.put, []

    def failing(self, sid, items):
        calls.append(sorted(items))
        original(self, sid, {n: t for n, t in items.items()
                             if written == "everything" or (written == "pages" and not n.startswith("g"))})
        return False

    monkeypatch.setattr(RedisPageStore, "put", failing)
    with pytest.raises(KVNotWritten):
        cache.persist()
    assert len(calls) == 1 and any(n.startswith("g") for n in calls[0]) and any(n.startswith("p") for n in calls[0])
    monkeypatch.setattr(RedisPageStore, "put", original)
    assert tables_in(private_redis, ns) == {f"g{v1['gen']}"}  # no part of a second generation
    elsewhere = spawn().load()
    assert elsewhere is not None and same(state(elsewhere), at_v1)
    # The next persist writes whole, and its commit leaves exactly its generation.
    v2 = cache.persist()
    assert set(table_names(v2["gen"], v2["layers"])) == {f"g{v2['gen']}/{f.decode()}" for f in
                                                         private_redis.client().hkeys(kv_key(ns, SID, f"g{v2['gen']}"))}
    assert a.commit(v2) == SAVED
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)
    again = spawn().load()
    assert again is not None and same(state(again), state(cache))


def test_a_group_the_store_lost_fails_the_commit_and_a_distrusting_persist_writes_it_again(private_redis, ns, spawn):
    a, cache, v1 = committed_once(spawn)
    turn(cache, 2)
    lost = next(g for g in v1["groups"] if not g.startswith("g"))
    private_redis.client().delete(kv_key(ns, SID, lost))  # Redis lost it (a failover to a lagging replica)
    v2 = cache.persist()  # believed held: not written again
    assert lost in v2["groups"] and lost not in groups_in(private_redis, ns)
    assert a.commit(v2) == KV_MISSING  # the record names no group that is not whole: nothing written
    assert tables_in(private_redis, ns) == {f"g{v1['gen']}"}
    a.host.locked(a.host.copies.distrust, SID)  # as the engine does on such a refusal
    v3 = cache.persist()  # every belief checked: the lost pages are written again
    assert a.commit(v3) == SAVED
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v3)
    again = spawn().load()
    assert again is not None and same(state(again), state(cache))


def saved_without_kv(a: Process, cache, monkeypatch) -> None:
    """A turn whose KV the store does not take (the persist fails), saved by a record that names no KV."""
    turn(cache, 2)
    monkeypatch.setattr(RedisPageStore, "put", lambda self, sid, items: False)
    with pytest.raises(KVNotWritten):
        cache.persist()
    monkeypatch.undo()
    assert a.commit(None) == SAVED  # the record holds the history without KV


def test_a_record_without_kv_leaves_what_the_one_before_named_pending_for_its_holder(private_redis, ns, spawn,
                                                                                     monkeypatch):
    a, cache, v1 = committed_once(spawn)
    saved_without_kv(a, cache, monkeypatch)
    assert set(v1["groups"]) <= groups_in(private_redis, ns)
    assert all(0 < ttl <= PENDING_TTL_S for ttl in ttls(private_redis, ns, v1["groups"]))
    private_redis.client().expire(kv_key(ns, SID, f"g{v1['gen']}"), 5)
    assert a.host.renew_pending() >= len(v1["groups"])  # renewed while the cache may need them
    assert all(ttl > 5 for ttl in ttls(private_redis, ns, v1["groups"]))
    # Redis takes KV again: the next record names a new generation, which restores elsewhere.
    v2 = cache.persist()
    assert a.commit(v2) == SAVED
    again = spawn().load()
    assert again is not None and same(state(again), state(cache))


def test_after_a_record_without_kv_the_next_one_with_kv_leaves_only_its_generation(private_redis, ns, spawn,
                                                                                   monkeypatch):
    a, cache, v1 = committed_once(spawn)
    saved_without_kv(a, cache, monkeypatch)
    v2 = cache.persist()
    assert a.commit(v2) == SAVED
    assert a.host.renew_pending() == 0  # nothing of the session is pending any more
    assert stored_keys(private_redis, ns) == named_keys(private_redis, ns, v2)


def test_a_page_table_that_does_not_match_its_record_is_refused_whole(private_redis, ns, spawn):
    a, cache, v1 = committed_once(spawn)
    assert spawn().restored({**v1, "history_len": v1["history_len"] + 1}) is None
    assert spawn().restored({**v1, "layers": v1["layers"] - 1}) is None
    assert spawn().restored({**v1, "gen": "../x"}) is None
    # A page of the generation gone (its group no longer whole): refused, and the refusing process took
    # nothing on.
    client = private_redis.client()
    group = next(g for g in v1["groups"] if not g.startswith("g"))
    key = kv_key(ns, SID, group)
    field = client.hkeys(key)[0]
    value = client.hget(key, field)
    client.hdel(key, field)
    other = spawn()
    assert other.restored(v1) is None
    assert other.host.copies.sessions() == 0
    assert set(other.host.where_many(SID, cache.prefill.cold[0].page_ids())) == {"none"}
    client.hset(key, field, value)  # whole again: the same generation restores
    back = spawn().restored(v1)
    assert back is not None and same(state(back), state(cache))


def test_a_session_whose_record_outlives_one_ttl_restores_its_kv(private_redis, ns, spawn):
    """A 4 s record TTL (KV: 5 s): saves every ~1.2 s for 7 s keep pages written at the start alive."""
    a, cache, ref = committed_once(spawn, ttl_s=4)
    first_pages = set(page_names(0, cache.prefill.cold[0].index_tensors()))
    start = time.monotonic()
    seed = 2
    while time.monotonic() - start < 7:
        time.sleep(1.2)
        turn(cache, seed, n_new=4, max_new=1)
        seed += 1
        ref = cache.persist()
        assert a.commit(ref) == SAVED
    assert first_pages & set(page_names(0, cache.prefill.cold[0].index_tensors())), "pages from the start are kept"
    restored = spawn(ttl_s=4).load()
    assert restored is not None and same(state(restored), state(cache))
    client = private_redis.client()
    assert all(0 < client.ttl(k) <= 5 for k in stored_keys(private_redis, ns))
