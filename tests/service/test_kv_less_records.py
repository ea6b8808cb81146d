"""A record saved without KV (the persist failed while the record's own write went through, as right
after a Redis outage) supersedes every earlier generation, is saved again with its KV once Redis takes
it, and whoever restores it sweeps what earlier holders left: no key outlives what a record names.
Real model, real (private) Redis."""
from __future__ import annotations

import secrets

import pytest
from replica_helpers import LONG, new_session, replica, turn

from app.engine import batcher as batcher_module
from bench.soak_checks import orphan_keys
from tiers.keys import session_key, writer_key


@pytest.fixture
async def replicas(make_engine, private_redis):
    """Two replicas sharing a namespace of the private Redis, closed after the test."""
    ns = f"rkvnokv-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name) for name in ("a", "b"))
    yield a, b
    await a.close()
    await b.close()


def failing_kv_writes(service, monkeypatch) -> None:
    """Every KV write to Redis fails; the record store's writes still go through."""
    monkeypatch.setattr(service.engine.redis, "put_pages", lambda sid, pages: False)


def tables(server, ns: str) -> set[str]:
    return {k.decode() for k in server.client().scan_iter(match=f"{ns}:*.index-l*", count=1000)}


async def test_a_record_without_kv_collects_older_generations_and_gets_its_kv_later(replicas, private_redis,
                                                                                  monkeypatch):
    a, b = replicas
    ns = a.store.ns
    sid, token = await new_session(a)
    first = await a.store.load(sid)
    assert first[0]["kv"] is not None and tables(private_redis, ns)

    with monkeypatch.context() as m:
        failing_kv_writes(a, m)
        await turn(a, sid, token, "What did the keeper write about?")
        data, version = await a.store.load(sid)
        assert data["kv"] is None and version == first[1] + 1  # the history is saved, without KV
        assert tables(private_redis, ns) == set()  # the generation it superseded is gone
        await a.repository.save_unsaved(a.access.digest)  # Redis still takes no KV: nothing written
        assert (await a.store.load(sid))[1] == version

    await a.repository.save_unsaved(a.access.digest)  # Redis takes KV again: saved with it
    data, saved = await a.store.load(sid)
    assert data["kv"] is not None and saved == version + 1
    assert orphan_keys(private_redis.client(), ns) == []
    await a.repository.save_unsaved(a.access.digest)  # nothing left to save
    assert (await a.store.load(sid))[1] == saved

    fed = a.engine.sessions[sid].fed_tokens
    moved = await turn(b, sid, token, "And the gulls?")
    assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed < 40  # its KV came back


async def test_restoring_a_record_without_kv_sweeps_what_its_earlier_holder_left(replicas, private_redis,
                                                                               monkeypatch):
    a, b = replicas
    ns = a.store.ns
    sid, token = await new_session(a)
    failing_kv_writes(a, monkeypatch)  # from here on a writes no KV (its retries neither)
    await turn(a, sid, token, "What did the keeper write about?")
    assert (await a.store.load(sid))[0]["kv"] is None
    # a's live copy still needs its pages in Redis, which no record names; a stops here (as if killed)
    left = orphan_keys(private_redis.client(), ns)
    assert left and all(k.startswith(session_key(ns, sid)) for k in left)

    await turn(b, sid, token, "And the gulls?")  # b re-prefills the history, then saves with its KV
    assert (await b.store.load(sid))[0]["kv"] is not None
    assert orphan_keys(private_redis.client(), ns) == []


def writers_log(server, ns: str) -> list[str]:
    return [m.decode() for m in server.client().zrange(f"{ns}:writing", 0, -1)]


async def killed(service) -> None:
    """As a replica killed mid-turn: its housekeeping stops and its KV writer's liveness lapses at once."""
    service._housekeeper.cancel()
    key = writer_key(service.store.ns, service.engine.redis.writer)
    await service.store.client.call(service.store.client.redis.delete(key), key=key)


async def test_what_a_dead_writer_left_unnamed_is_swept_and_what_its_record_names_is_kept(replicas,
                                                                                           private_redis):
    a, b = replicas
    ns = a.store.ns
    sid, token = await new_session(a)
    await turn(b, sid, token, "What did the keeper write about?")  # b holds it now, its pages named
    saved = b.store.save

    async def lost(*args):  # b's next save never lands: as if b were killed before its record's write
        raise ConnectionError("killed")

    b.store.save = lost
    await turn(b, sid, token, "And the gulls?")
    b.store.save = saved
    left = orphan_keys(private_redis.client(), ns)
    assert left and f"{b.engine.redis.writer}|{sid}" in writers_log(private_redis, ns)
    await killed(b)

    await a.repository.sweep_dead_writers()
    assert orphan_keys(private_redis.client(), ns) == []  # what b left unnamed is gone
    assert not [e for e in writers_log(private_redis, ns) if e.startswith(b.engine.redis.writer)]
    # What b's committed record names (b wrote it) is kept: a restores it and prefills only the new turn.
    fed = (await a.store.load(sid))[0]["kv"]["history_len"]
    moved = await turn(a, sid, token, "And the ships?")
    assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed < 40


async def test_a_later_message_stopped_half_way_keeps_the_record_s_kv_and_restores_from_it(make_engine,
                                                                                           private_redis,
                                                                                           monkeypatch):
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
        assert orphan_keys(private_redis.client(), ns) == []
        again = await turn(a, sid, token, "And the gulls?")  # restored from it: only the new turn prefilled
        assert again.usage.prefilled_tokens == again.usage.prompt_tokens - before["history_len"] < 40
    finally:
        await a.close()
