"""A record saved without KV (the persist failed while the record's own write went through, as right
after a Redis outage) carries what the cache had been fed, leaves the KV groups the record named before
pending for their holder (which renews them), and is saved again with its KV once Redis takes it. A
restore elsewhere rebuilds the very same cache: by replaying the record's feeds while it names no KV,
from its KV once saved. Nothing a record names goes missing, and nothing no record names outlives the
pending TTL once its holder stops renewing it. Real model, real (private) Redis."""
from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import pytest
from replica_helpers import LONG, events_of, new_session, replica, turn

from app.contract.events import Delta, Done
from app.engine import batcher as batcher_module
from app.engine.sampling import SamplingParams
from bench.soak_checks import missing_groups, orphan_keys
from tiers.store.redis.keys import kv_key, session_key

PENDING_S = 10  # the shortest pending TTL the settings allow


@pytest.fixture
async def replicas(make_engine, private_redis):
    """Two replicas sharing a namespace of the private Redis (KV no record names lives ``PENDING_S``
    unless renewed), closed after the test."""
    ns = f"rkvnokv-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name, redis_pending_ttl_s=PENDING_S) for name in ("a", "b"))
    yield a, b
    await a.close()
    await b.close()


def failing_kv_writes(service, monkeypatch) -> None:
    """Every KV write to Redis fails; the record store's writes still go through."""
    monkeypatch.setattr(service.engine.redis, "put", lambda sid, items: False)


def named_groups(server, ns: str, sid: str) -> list[str]:
    """The KV groups the session's record names."""
    return (server.client().hget(session_key(ns, sid), "groups") or b"").decode().split()


def tables(server, ns: str, sid: str) -> set[str]:
    """The session's generations' table groups (``g<gen>``) in Redis."""
    prefix = kv_key(ns, sid, "")
    return {k.decode()[len(prefix):] for k in server.client().scan_iter(match=kv_key(ns, sid, "g*"), count=1000)}


async def killed(service) -> None:
    """As a replica killed mid-turn: its housekeeping, and the engine's renewal of what it wrote, stop."""
    service.engine.renewal.close()
    service._housekeeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await service._housekeeper


def reply(events: list) -> str:
    assert isinstance(events[-1], Done), events[-1]
    return "".join(e.text for e in events if isinstance(e, Delta))


async def test_a_record_without_kv_leaves_older_groups_pending_and_gets_its_kv_later(replicas, private_redis,
                                                                                    monkeypatch):
    """A turn whose KV Redis refuses is saved without it (the history, and what the cache had been fed);
    the groups the record named before stay, pending, renewed by their holder; once Redis takes KV the
    session is saved again with it, and a restore elsewhere comes from that KV."""
    a, b = replicas
    ns, client = a.store.ns, private_redis.client()
    sid, token = await new_session(a)
    first_data, first = await a.store.load(sid)
    before = named_groups(private_redis, ns, sid)
    assert first_data["kv"] is not None and tables(private_redis, ns, sid) == {f"g{first_data['kv']['gen']}"}
    assert before and all(client.ttl(kv_key(ns, sid, g)) > a.store.ttl_s for g in before)

    with monkeypatch.context() as m:
        failing_kv_writes(a, m)
        await turn(a, sid, token, "What did the keeper write about?")
        data, stored = await a.store.load(sid)
        # The history is saved, without KV, with what the cache had been fed.
        assert data["kv"] is None and data["fed"] == a.engine.sessions[sid].fed_tokens > 0
        assert stored.lineage[-2:] == (first.tag, stored.tag) and named_groups(private_redis, ns, sid) == []
        # What the record named before is left pending, not deleted: its holder still needs it, and renews it.
        assert all(0 < client.ttl(kv_key(ns, sid, g)) <= PENDING_S for g in before)
        assert await a.engine.renew_pending() >= len(before)
        await a.repository.save_unsaved(a.access.digest)  # Redis still takes no KV: nothing written
        assert (await a.store.stored(sid)).tag == stored.tag

    await a.repository.save_unsaved(a.access.digest)  # Redis takes KV again: saved with it
    data, saved = await a.store.load(sid)
    assert data["kv"] is not None and data["fed"] is None and saved.lineage[-2:] == (stored.tag, saved.tag)
    named = named_groups(private_redis, ns, sid)
    assert f"g{data['kv']['gen']}" in named and all(client.ttl(kv_key(ns, sid, g)) > a.store.ttl_s for g in named)
    assert missing_groups(client, ns) == [] and all(0 < client.ttl(k) <= PENDING_S for k in orphan_keys(client, ns))
    await a.repository.save_unsaved(a.access.digest)  # nothing left to save
    assert (await a.store.stored(sid)).tag == saved.tag

    fed = a.engine.sessions[sid].fed_tokens
    moved = await turn(b, sid, token, "And the gulls?")
    assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed < 40  # its KV came back
    assert b.engine.rebuilds["kv_restored"] == 1 and not b.engine.rebuilds["replayed"]


async def test_the_generation_a_record_without_kv_superseded_goes_within_the_pending_ttl(replicas, private_redis,
                                                                                       monkeypatch):
    """Once the session is saved again with its KV, nothing the earlier records named and the new one does
    not outlives the pending TTL, though its holder is alive and renewing what it still needs."""
    a, _ = replicas
    ns, client = a.store.ns, private_redis.client()
    sid, token = await new_session(a)
    with monkeypatch.context() as m:
        failing_kv_writes(a, m)
        await turn(a, sid, token, "What did the keeper write about?")
    await a.repository.save_unsaved(a.access.digest)  # saved with its KV
    assert (await a.store.load(sid))[0]["kv"] is not None and a.repository.stored(sid)
    deadline = time.monotonic() + PENDING_S + 2
    while orphan_keys(client, ns) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert orphan_keys(client, ns) == [] and missing_groups(client, ns) == []


async def test_a_record_without_kv_is_rebuilt_elsewhere_by_replay_and_what_its_holder_left_expires(
        replicas, private_redis, monkeypatch):
    """A record without KV whose holder dies is restored elsewhere by replaying its feeds: the very cache
    the holder had (the same reply), saved there with its KV; what the dead holder wrote and no record
    names is gone within the pending TTL, what the new record names stays."""
    a, b = replicas
    ns, client = a.store.ns, private_redis.client()
    sid, token = await new_session(a)
    failing_kv_writes(a, monkeypatch)  # from here on a writes no KV (its retries neither)
    await turn(a, sid, token, "What did the keeper write about?")
    data, _ = await a.store.load(sid)
    assert data["kv"] is None and data["fed"] == a.engine.sessions[sid].fed_tokens > 0
    await killed(a)  # a stops here (as if killed): nobody renews the KV it wrote, which no record names
    left = orphan_keys(client, ns)
    assert left and all(k.startswith(session_key(ns, sid)) for k in left)

    events = await events_of(b, sid, token, "And the gulls?")  # b replays the record's feeds
    moved = events[-1]
    assert b.engine.rebuilds["replayed"] == 1 and not b.engine.rebuilds["reprefilled"]
    assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens  # the whole history fed again
    # The very cache a held: the reply is the one a's own copy gives to the same message.
    held = await a.engine.complete(sid, "And the gulls?", SamplingParams(max_tokens=4))
    assert reply(events) == held.text
    assert (await b.store.load(sid))[0]["kv"] is not None and missing_groups(client, ns) == []

    deadline = time.monotonic() + PENDING_S + 10
    while orphan_keys(client, ns) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert orphan_keys(client, ns) == []  # what a left is gone after the pending TTL
    assert missing_groups(client, ns) == [] and named_groups(private_redis, ns, sid)  # b's record's KV stays


async def test_what_a_killed_holder_left_unnamed_expires_and_what_its_record_names_is_kept(replicas, private_redis):
    """A holder killed before its last turn's record lands leaves that turn's KV pending (the short TTL,
    nobody renewing it) and the KV its committed record names living as long as the record, from which
    another replica restores the session prefilling only the new turn."""
    a, b = replicas
    ns, client = a.store.ns, private_redis.client()
    sid, token = await new_session(a)
    await turn(b, sid, token, "What did the keeper write about?")  # b holds it now, its pages named
    named = named_groups(private_redis, ns, sid)
    saved = b.store.save

    async def lost(*args):  # b's next save never lands: as if b were killed before its record's write
        raise ConnectionError("killed")

    b.store.save = lost
    await turn(b, sid, token, "And the gulls?")
    await killed(b)
    b.store.save = saved
    left = orphan_keys(client, ns)
    assert left and all(k.startswith(session_key(ns, sid)) for k in left)
    # What b left unnamed goes within the pending TTL, nobody renewing it; what its record names lives
    # as long as the record.
    assert all(0 < client.ttl(k) <= PENDING_S for k in left)
    assert named_groups(private_redis, ns, sid) == named and missing_groups(client, ns) == []
    assert all(client.ttl(kv_key(ns, sid, g)) > a.store.ttl_s for g in named)
    # What b's committed record names (b wrote it) is there: a restores it and prefills only the new turn.
    fed = (await a.store.load(sid))[0]["kv"]["history_len"]
    moved = await turn(a, sid, token, "And the ships?")
    assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed < 40
    assert a.engine.rebuilds["kv_restored"] == 1 and not a.engine.rebuilds["replayed"]


async def test_a_later_message_stopped_half_way_keeps_the_record_s_kv_and_restores_from_it(make_engine,
                                                                                           private_redis,
                                                                                           monkeypatch):
    """A later message cancelled half way through its layer-by-layer prefill is undone: the record still
    names the generation it named, nothing is left that no record names, and the next turn restores the
    cache from that generation."""
    monkeypatch.setattr(batcher_module, "ALONE_SLICE_S", 0.01)
    ns = f"rkvstop-{secrets.token_hex(3)}"
    a = replica(make_engine, private_redis.url, ns, "a")
    a.engine.batcher.prefill_chunk = 64  # a message longer than this is fed layer by layer (it has cold pages)
    try:
        sid, token = await new_session(a)
        before = (await a.store.load(sid))[0]["kv"]
        assert a.engine.sessions[sid].cache.layers_later()
        slices, after_step, fired = a.engine.batcher.stats.layered_slices, a.engine.batcher.on_step, []

        def on_step(keys):
            after_step(keys)
            if sid in keys and a.engine.batcher.stats.layered_slices > slices + 3 and not fired:
                fired.append(a.engine.cancel(sid))

        a.engine.batcher.on_step = on_step
        stopped = await turn(a, sid, token, LONG + " Which ships passed by?")
        a.engine.batcher.on_step = after_step
        assert fired and stopped.finish_reason == "cancelled"
        # The turn was undone; the record still names the generation it named (nothing of it collected).
        assert (await a.store.load(sid))[0]["kv"]["gen"] == before["gen"]
        assert orphan_keys(private_redis.client(), ns) == [] and missing_groups(private_redis.client(), ns) == []
        again = await turn(a, sid, token, "And the gulls?")  # restored from it: only the new turn prefilled
        assert again.usage.prefilled_tokens == again.usage.prompt_tokens - before["history_len"] < 40
    finally:
        await a.close()
