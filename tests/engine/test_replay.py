"""A lost cache rebuilt by replaying the session's turns (app/engine/replay.py): stopped by a cancel with
the session whole, reporting how far it is, capped, carried by the session record to another process,
and holding device memory for the history it rebuilds.

A session loses cold pages as when Redis restarts empty: its tiered cache spills nearly every cold page to
Redis (a host tier of 128 pages), then the session's keys are deleted there, so the next turn finds pages
that no tier holds. A replay rebuilds the very cache that was lost: the reply is the one a session that
lost nothing gives.
"""
import dataclasses
import json
import secrets

import pytest

from app.engine.engine import Engine
from app.engine.errors import StoreUnavailable
from app.engine.events import TextDelta, TurnDone, TurnStatus
from app.engine.replay import TEACHER_FORCED
from app.engine.sampling import SamplingParams
from app.session_restore import record, restore
from app.settings import Settings
from bench.haystack import hide
from tiers.store.redis.keys import kv_key

pytestmark = pytest.mark.slow
FACTS = ["The pass key for the red door is 41735.", "The pass key for the blue door is 90264."]
TURNS = [hide(FACTS, 700, [0.2, 0.7], seed=5) + "\n\nWhat is the pass key for the red door?",
         "What is the pass key for the blue door?", "Say the red door's key again."]
NEXT = "Thanks! Which doors did I ask about?"
PARAMS = SamplingParams(max_tokens=8)
TIERED = {"mode": "tiered", "token_budget": 64, "page_tokens": 16}
TIGHT = 1 << 20  # the smallest host tier: 128 pages of 16 tokens, a small part of the cold history


@pytest.fixture
def lossy(make_engine, redis_url):
    """Engines over one Redis namespace with a tight host tier, and ``lose(session_id)``: Redis forgets
    every page of the session (an empty restart, as far as it goes)."""
    import redis

    namespace = f"rkvtest-{secrets.token_hex(3)}"
    client = redis.Redis.from_url(redis_url)

    def make(**overrides):
        return make_engine(**TIERED, host_tier_bytes=TIGHT, redis_url=redis_url, redis_namespace=namespace, **overrides)

    def lose(session_id: str) -> None:
        keys = list(client.scan_iter(match=kv_key(namespace, session_id, "*")))
        assert keys, "the test needs pages in Redis"
        client.delete(*keys)

    yield make, lose
    for key in client.scan_iter(match=f"{namespace}:*"):
        client.delete(key)


async def converse(engine, turns=TURNS):
    session = engine.create_session()
    for text in turns:
        await engine.complete(session.id, text, PARAMS)
    return session


@pytest.fixture(scope="module")
async def expected(loaded) -> str:
    """The next reply of a session that lost nothing (no Redis, a host tier with room to spare): made once
    for the module, the replies compared with it being deterministic."""
    engine = Engine(Settings(**TIERED), loaded=loaded)
    try:
        session = await converse(engine)
        return (await engine.complete(session.id, NEXT, PARAMS)).text
    finally:
        engine.close()


async def turn(engine, session, text=NEXT):
    """A turn's events: its statuses, then (checked) its text and its ``TurnDone``."""
    events = [e async for e in await engine.chat(session.id, text, PARAMS)]
    statuses = [e for e in events if isinstance(e, TurnStatus)]
    first_text = next((i for i, e in enumerate(events) if isinstance(e, TextDelta)), len(events))
    assert all(isinstance(e, TurnStatus) for e in events[:first_text]) and len(statuses) == first_text
    assert isinstance(events[-1], TurnDone)
    return statuses, events[-1]


async def test_a_cancel_stops_a_replay_and_the_session_stays_whole(lossy, expected):
    make, lose = lossy
    engine = make()
    session = await converse(engine)
    lose(session.id)
    before = list(session.messages), list(session.token_ids), [dataclasses.replace(f) for f in session.feeds]

    events = []
    async for event in await engine.chat(session.id, NEXT, PARAMS):
        events.append(event)
        if isinstance(event, TurnStatus) and event.done == 1:
            assert engine.cancel(session.id)  # as the WebSocket's `cancel` does
    # Stopped before the second replayed turn: undone, as a turn stopped in its prefill is.
    assert [e.done for e in events if isinstance(e, TurnStatus)] == [0, 1]
    assert isinstance(events[-1], TurnDone) and events[-1].finish_reason == "cancelled"
    assert not any(isinstance(e, TextDelta) for e in events)
    assert (session.messages, session.token_ids, session.feeds) == before and session.lost_fed > 0
    # The half-built cache is gone, and with it everything the turn held.
    assert session.cache is None and not session.busy and not session.cancel_requested
    mem = engine.memory_account
    assert session.id not in mem.reserved and session.id not in mem.chunking and mem.held.get(session.id, 0) == 0
    assert engine.host_tier.session_bytes(session.id) == 0 and engine.host_tier.reserved_bytes() == 0

    # A caller that goes away mid-replay (a closed connection) stops it the same way.
    events = await engine.chat(session.id, NEXT, PARAMS)
    async for event in events:
        if isinstance(event, TurnStatus) and event.done == 2:
            break
    await events.aclose()
    await engine.batcher.run(lambda: None)  # the dropped cache's pages are freed by a job queued before this
    assert (session.messages, session.token_ids, session.feeds) == before and session.lost_fed > 0
    assert session.cache is None and not session.busy and session.id not in mem.reserved
    assert engine.host_tier.session_bytes(session.id) == 0

    # The next turn rebuilds again, all of it, and answers as if nothing had been lost.
    statuses, done = await turn(engine, session)
    assert statuses[-1].done == statuses[-1].total == len(TURNS)
    assert done.text == expected and session.lost_fed == 0 and len(session.feeds) == len(TURNS) + 1


async def test_a_replay_reports_how_far_it_is(lossy, expected):
    make, lose = lossy
    engine = make()
    session = await converse(engine)
    fed, feeds = session.cache.history_len, [dataclasses.replace(f) for f in session.feeds]
    lose(session.id)

    statuses, done = await turn(engine, session)
    # One status before the first replayed turn and one after each, all before the reply's first text.
    assert [(s.stage, s.done, s.total) for s in statuses] == [("replay", i, len(TURNS)) for i in range(len(TURNS) + 1)]
    tokens = [s.tokens for s in statuses]
    assert tokens[0] == 0 and tokens == sorted(tokens) and tokens[-1] == fed
    assert {s.total_tokens for s in statuses} == {fed}
    assert done.text == expected and done.usage.prefilled_tokens == done.usage.prompt_tokens
    assert session.feeds[:-1] == feeds and session.lost_fed == 0


async def test_a_history_over_the_cap_is_prefilled_in_one_go(lossy):
    make, lose = lossy
    engine = make(replay_max_tokens=900)
    session = await converse(engine)
    assert session.cache.history_len > 900
    lose(session.id)

    statuses, done = await turn(engine, session)
    assert statuses == [] and done.usage.prefilled_tokens == done.usage.prompt_tokens
    # One prefill of the whole history: the cache's log starts again from this turn.
    assert len(session.feeds) == 1 and session.feeds[0].prefill == done.usage.prompt_tokens
    assert session.lost_fed == 0 and session.cache.history_len == sum(f.prefill + f.decodes for f in session.feeds)


async def test_the_feed_log_goes_with_the_session_record_and_another_process_replays_it(lossy, expected):
    make, lose = lossy
    engine = make()
    session = await converse(engine)
    kv = await engine.persist(session.id)
    data = json.loads(json.dumps(record(session, "digest", kv)))  # as the store keeps it
    assert data["feeds"] == [[f.prefill, f.max_new, f.decodes] for f in session.feeds]

    # Another process, after Redis lost the session's pages: the record's KV cannot be restored.
    other = make()
    lose(session.id)
    for bad in ([[1, 2]], [["7", 8, 0]], [[True, 8, 0]], "feeds", [[data["feeds"][0][0] + 1, 8, 0]],
                [[0, 8, 0], *data["feeds"]], [[f[0], f[1], f[1]] for f in data["feeds"]]):
        assert restore(other, {**data, "feeds": bad}).feeds == []  # malformed, or not this cache's: no log
        other.drop(session.id)
    restored = restore(other, data)
    assert restored.feeds == session.feeds and restored.cache is None

    statuses, done = await turn(other, restored)
    assert [s.done for s in statuses] == list(range(len(TURNS) + 1))
    assert done.text == expected and done.usage.prefilled_tokens == done.usage.prompt_tokens


async def test_a_replay_holds_device_memory_for_the_history_it_rebuilds(lossy, monkeypatch):
    make, lose = lossy
    engine = make()
    mem = engine.memory_account
    session = engine.create_session()
    held_by_turns = []  # what each turn reserved when it first ran
    for text in TURNS:
        async for event in await engine.chat(session.id, text, PARAMS):
            if isinstance(event, TextDelta) and len(held_by_turns) < len(session.turns) + 1:
                held_by_turns.append(mem.reserved[session.id])
    lose(session.id)

    during = []  # the reservation at each replayed decode step
    decode = engine.batcher.decode

    async def watched(key, cache, token, sampler):
        if sampler is TEACHER_FORCED:
            during.append(mem.reserved.get(key, 0) + mem.chunking.get(key, 0))
        return await decode(key, cache, token, sampler)

    monkeypatch.setattr(engine.batcher, "decode", watched)
    done = await engine.complete(session.id, NEXT, PARAMS)
    assert done.finish_reason in ("stop", "length") and during
    # The replay runs the turns again, each holding what it held then: it reserves at least what each
    # reserved, not what one prefill into an empty cache needs; and what it held stayed within that.
    assert min(during) >= max(held_by_turns)
    assert mem.overruns == 0


async def test_a_replay_that_finds_redis_gone_refuses_the_turn_and_leaves_the_session_whole(lossy, expected,
                                                                                          monkeypatch):
    """The replay demotes pages as the turns it feeds did, and with a small host tier most spill to Redis;
    Redis then stops answering, after one replayed turn (the next one cannot read them back), then, on the
    next try, after all of them (the turn's own prefill cannot): each time the turn is refused as
    ``store_unavailable`` (not failed as the engine's fault, which would keep it in the history), and the
    session is as before it, its cache still to rebuild."""
    make, lose = lossy
    engine = make()
    session = await converse(engine)
    lose(session.id)
    before = list(session.messages), list(session.token_ids), [dataclasses.replace(f) for f in session.feeds]
    fed = session.fed_tokens  # what the cache that lost its pages had been fed: what a rebuild replays
    store = engine.host_tier.store
    reads = store.get

    for gone_after in (1, len(TURNS)):
        with pytest.raises(StoreUnavailable, match="cannot be reached"):
            async for event in await engine.chat(session.id, NEXT, PARAMS):
                assert not isinstance(event, TextDelta)
                if isinstance(event, TurnStatus) and event.done == gone_after:  # Redis stops answering
                    monkeypatch.setattr(store, "get", lambda sid, names: [None] * len(names))
        assert (session.messages, session.token_ids, session.feeds) == before
        assert session.cache is None and not session.busy and session.id not in engine.memory_account.reserved
        assert session.lost_fed == fed
        await engine.batcher.run(lambda: None)  # the dropped cache's pages are freed by a job queued before this
        assert engine.host_tier.session_bytes(session.id) == 0 and engine.host_tier.reserved_bytes() == 0
        monkeypatch.setattr(store, "get", reads)  # Redis is back

    statuses, done = await turn(engine, session)  # the next turn rebuilds all of it
    assert statuses[-1].done == statuses[-1].total == len(TURNS)
    assert done.text == expected and session.lost_fed == 0
