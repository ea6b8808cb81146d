"""Tiered sessions through the engine: nothing lost, bounded device memory, Redis outages survived.

(Exact resume from Redis in another process goes through the session record: tests/e2e/test_session_record.py.)
"""
import asyncio
import secrets
import threading

import pytest
import torch

from app.engine.errors import DeviceMemoryExhausted, HostMemoryExhausted
from app.engine.events import TextDelta
from app.engine.sampling import SamplingParams
from bench.haystack import hide
from rocketkv_mt.cache.decode.hsa import HSADecode
from rocketkv_mt.cache.prefill.tiered import ReselectTiered

pytestmark = pytest.mark.slow
FACTS = ["The pass key for the red door is 41735.", "The pass key for the blue door is 90264."]
FIRST = hide(FACTS, 700, [0.2, 0.7], seed=5) + "\n\nWhat is the pass key for the red door?"
LATER = ["What is the pass key for the blue door?", "Say the red door's key again.", "Thanks! Which doors did I ask about?",
         "Name one colour.", "Say goodbye."]
PARAMS = SamplingParams(max_tokens=12)
PAGE_BYTES = 32 * 64 * 2 * 4  # one cold page of the bundled model: 32 tokens of one KV head, keys and values, fp32


def positions_held(cache, layer: int, head: int) -> torch.Tensor:
    primary = cache.layers[layer].positions[head].cpu()
    return torch.cat([primary, cache.prefill.cold[layer].held_positions(head)]).sort().values


async def converse(engine, session, turns):
    outs = []
    for text in turns:
        outs.append(await engine.complete(session.id, text, PARAMS))
    return outs


@pytest.mark.parametrize("ranking", [{"page_grouping": "keys", "sketch_bits": 0}, {"sketch_bits": 2}, {}],
                         ids=["bounds", "sketch2", "default"])
async def test_every_position_is_in_exactly_one_tier_after_every_turn(make_engine, redis_url, ranking):
    # A host tier of 288 pages (9,216 cold tokens of all layers and heads) forces spills to Redis, so
    # all three tiers hold part of the history.
    engine = make_engine(mode="tiered", token_budget=128, redis_url=redis_url, redis_namespace=f"rkvtest-{secrets.token_hex(3)}",
                         host_tier_bytes=288 * PAGE_BYTES, page_tokens=32, **ranking)
    session = engine.create_session()
    try:
        for text in [FIRST, *LATER[:2]]:
            done = await engine.complete(session.id, text, PARAMS)
            cache = session.cache
            assert cache.history_len == session.fed_tokens
            for layer in range(len(cache.layers)):
                for head in range(cache.spec.num_kv_heads):
                    assert torch.equal(positions_held(cache, layer, head), torch.arange(cache.history_len)), (layer, head)
            assert done.memory.device_bytes > 0 and done.memory.host_bytes > 0
        assert engine.host_tier.stats.spills > 0 and engine.host_tier.stats.bytes <= engine.host_tier.capacity_bytes
        assert done.memory.redis_bytes > 0
        assert session.turns[1].readmitted_tokens > 0  # a later turn brought cold tokens back
    finally:
        await engine.delete_session(session.id)


async def test_a_sketch_decoded_ahead_on_the_page_reader_gives_the_same_turns(make_engine, monkeypatch):
    # A pool that holds every cold page lets the page reader decode layer l+1's sketch while layer l
    # computes; the turns must be those of the same session decoding each layer's sketch inline.
    engine = make_engine(mode="tiered", token_budget=128, page_tokens=32, page_grouping="position", sketch_bits=4,
                         sketch_pool=64, digest_read_whole=0)
    started = []
    start = engine.transfers.start
    monkeypatch.setattr(engine.transfers, "start", lambda fn, **kw: started.append(fn) or start(fn, **kw))
    ahead = engine.create_session()
    a = await converse(engine, ahead, [FIRST, *LATER[:2]])
    assert len(started) >= 2 * (engine.runner.spec.num_layers - 1)  # both later turns decoded layers 1.. ahead
    monkeypatch.setattr(engine, "transfers", None)  # a cache made now reads on the model thread alone
    inline = engine.create_session()
    b = await converse(engine, inline, [FIRST, *LATER[:2]])
    assert inline.token_ids == ahead.token_ids
    assert [d.memory.digest_bytes_read for d in a] == [d.memory.digest_bytes_read for d in b]
    assert a[-1].memory.readmitted_tokens > 0


async def test_a_small_cold_set_is_read_whole_as_exhaustive_reads_it(make_engine):
    # ~700 tokens at budget 128: in the second turn every layer's cold pages are within 1.5 times those a
    # digest turn reads, so it reads them all and applies its selection at once, as exhaustive does.
    turns = {}
    for name, settings in {"whole": {}, "exhaustive": {"reselect": "exhaustive"}, "ranked": {"digest_read_whole": 0}}.items():
        engine = make_engine(mode="tiered", token_budget=128, **settings)
        session = engine.create_session()
        turns[name] = (session, await converse(engine, session, [FIRST, LATER[0]]))
    (whole, a), (exhaustive, b), (ranked, c) = turns.values()
    assert whole.token_ids == exhaustive.token_ids
    assert [d.memory.cold_bytes_read for d in a] == [d.memory.cold_bytes_read for d in b]
    assert a[-1].memory.cold_bytes_read > 0 and all(d.memory.digest_bytes_read == 0 for d in a)
    # Ranked instead, the same cold sets cost sketch reads and fewer page reads.
    assert c[-1].memory.digest_bytes_read > 0 and c[-1].memory.cold_bytes_read < a[-1].memory.cold_bytes_read


async def test_budget_above_history_gives_full_tokens(make_engine):
    engine = make_engine()
    full = engine.create_session(mode="full")
    tiered = engine.create_session(mode="tiered", budget=4096)
    await converse(engine, full, [FIRST, *LATER[:2]])
    await converse(engine, tiered, [FIRST, *LATER[:2]])
    assert tiered.token_ids == full.token_ids
    assert tiered.cache.cold_tokens() == 0


@pytest.mark.parametrize("prefill_attention", ["dense", "selected"])
async def test_tiered_matches_the_papers_rocketkv_mt(make_engine, prefill_attention):
    # Reading every cold page back, the tiered turn scores what rocketkv-mt scores.
    engine = make_engine(prefill_attention=prefill_attention, reselect="exhaustive")
    mt = engine.create_session(mode="rocketkv-mt", budget=128)
    tiered = engine.create_session(mode="tiered", budget=128)
    a = await converse(engine, mt, [FIRST, *LATER[:2]])
    b = await converse(engine, tiered, [FIRST, *LATER[:2]])
    if prefill_attention == "dense":  # same selection, same attention: the same tokens
        assert tiered.token_ids == mt.token_ids
    assert tiered.cache.kept_tokens() < mt.cache.kept_tokens()
    assert b[-1].memory.device_bytes < a[-1].memory.device_bytes


async def test_device_memory_is_bounded_while_full_and_mt_grow(make_engine):
    engine = make_engine()
    sessions = {m: engine.create_session(mode=m, budget=128) for m in ("full", "rocketkv-mt", "tiered")}
    history = {m: [] for m in sessions}
    for text in [FIRST, *LATER]:
        for mode, session in sessions.items():
            before = len(session.token_ids)
            done = await engine.complete(session.id, text, PARAMS)
            history[mode].append(done.memory.device_bytes)
            if mode == "tiered":
                cache = session.cache
                spec, split = cache.spec, cache.split
                per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
                turn_tokens = len(session.token_ids) - before
                capacity = split.prompt_budget + PARAMS.max_tokens
                kv_bound = (capacity + turn_tokens) * per_token
                kt_bound = -(-(capacity + turn_tokens) // split.page_size) * per_token
                assert done.memory.device_bytes <= kv_bound + kt_bound
    for mode in ("full", "rocketkv-mt"):
        assert all(b > a for a, b in zip(history[mode], history[mode][1:])), mode
    assert history["tiered"][-1] < history["full"][-1]
    assert history["tiered"][-1] - history["tiered"][0] < (history["full"][-1] - history["full"][0]) / 2


async def test_a_redis_outage_is_reported_and_the_host_tiers_bound_holds(make_engine):
    engine = make_engine(mode="tiered", token_budget=128, redis_url="redis://127.0.0.1:1/0", host_tier_bytes=1 << 20,
                         redis_timeout_s=0.3)
    session = engine.create_session()
    # Redis is found down when the engine starts (its configuration cannot be read) or, failing that, when a
    # spill finds it down; then the circuit is open and tries are refused at admission: either way the
    # session is as before, and the host tier within its bound.
    for _ in range(2):
        with pytest.raises(HostMemoryExhausted):
            await engine.complete(session.id, FIRST, PARAMS)
        assert session.messages == [] and session.token_ids == [] and not session.busy
        assert engine.host_tier.stats.bytes <= engine.host_tier.capacity_bytes
    client = engine.redis.client
    assert client.healthy is False and engine.redis.last_error and engine.redis.unavailable()
    assert client.circuit()["redis_circuit_opens"] >= 1  # what /metrics reports of the outage
    assert engine.host_tier.stats.bytes == 0 and engine.stats()["turns_refused_host_memory"] == 2
    done = await engine.complete(session.id, "Say hello.", PARAMS)  # a turn that demotes nothing goes on
    assert done.usage.generated_tokens > 0


async def test_cold_chunks_lost_with_redis_are_rebuilt_in_the_same_turn(make_engine, tmp_path):
    from serving_helpers import RedisServer

    with RedisServer(tmp_path) as redis_server:
        # A host tier of 2,000 pages: a longer session after the first spills all of the first one's pages
        # to this private Redis; once that one is deleted, the host tier has room to rebuild the first.
        engine = make_engine(mode="tiered", token_budget=128, redis_url=redis_server.url,
                             redis_namespace=f"rkvtest-{secrets.token_hex(3)}",
                             host_tier_bytes=2000 * PAGE_BYTES, page_tokens=32, redis_timeout_s=0.3)
        session, other = engine.create_session(), engine.create_session()
        try:
            await engine.complete(session.id, FIRST, PARAMS)
            await engine.complete(other.id, hide(FACTS, 1800, [0.3, 0.6], seed=9) + "\n\nWhich doors?", PARAMS)
            assert engine.host_tier.stats.spills > 0 and engine.host_tier.session_bytes(session.id) == 0
            history = len(session.token_ids)
            redis_server.stop()
            await engine.delete_session(other.id)
            done = await engine.complete(session.id, LATER[0], PARAMS)
            # The spilled chunks were unreadable: the turn re-prefilled the whole history and answered.
            assert done.finish_reason in ("stop", "length") and done.usage.generated_tokens > 0
            assert done.usage.prefilled_tokens > history
            assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
            assert not any(m.get("error") for m in session.messages)
            assert engine.host_tier.stats.bytes <= engine.host_tier.capacity_bytes
            cache = session.cache
            for layer in (0, len(cache.layers) - 1):
                assert torch.equal(positions_held(cache, layer, 0), torch.arange(cache.history_len))
            done = await engine.complete(session.id, LATER[1], PARAMS)  # and the session goes on
            assert done.usage.generated_tokens > 0 and done.usage.prefilled_tokens < 40
        finally:
            await engine.delete_session(session.id)


async def test_a_failed_turn_frees_its_host_chunks_and_the_session_goes_on(make_engine):
    engine = make_engine(mode="tiered", token_budget=128, host_tier_bytes=1 << 26)
    session = engine.create_session()
    try:
        await engine.complete(session.id, FIRST, PARAMS)
        assert engine.host_tier.session_bytes(session.id) > 0

        def failing(layer, *args):
            raise RuntimeError("injected decode failure")

        # A decode step alone or batched with others: either way it fails.
        session.cache.decode_attention = session.cache.decode_target = failing
        with pytest.raises(RuntimeError, match="injected"):
            await engine.complete(session.id, LATER[0], PARAMS)
        # The dropped cache's cold chunks are freed at once, not left until the session is deleted.
        assert session.cache is None and engine.host_tier.session_bytes(session.id) == 0
        done = await engine.complete(session.id, LATER[0], PARAMS)
        assert done.usage.generated_tokens > 0 and done.usage.prefilled_tokens == done.usage.prompt_tokens
        assert engine.host_tier.session_bytes(session.id) > 0
    finally:
        await engine.delete_session(session.id)


async def test_a_one_token_reply_applies_its_turns_selection(make_engine):
    # A reply that ends at its first token (max_tokens=1, or an end token) has no decode step to settle
    # the turn's re-selection: the turn's end applies it, and the next turn builds on it.
    engine = make_engine(mode="tiered", token_budget=128)
    session = engine.create_session()
    try:
        await engine.complete(session.id, FIRST, PARAMS)
        one = await engine.complete(session.id, LATER[0], SamplingParams(max_tokens=1))
        assert one.usage.generated_tokens == 1
        cache = session.cache
        assert cache.history_len == session.fed_tokens
        for layer in range(len(cache.layers)):
            held = torch.cat([cache.layers[layer].positions[0].cpu(), cache.prefill.cold[layer].held_positions(0)])
            assert torch.equal(held.sort().values, torch.arange(cache.history_len)), layer
        done = await engine.complete(session.id, LATER[1], PARAMS)
        assert done.usage.generated_tokens > 0
    finally:
        await engine.delete_session(session.id)


async def _leave_at_first_token(engine, session, text):
    """Start a turn and leave it (as a closed connection does) at its first streamed token, before any
    decode step: its prefill's re-selection is still to apply."""
    events = await engine.chat(session.id, text, PARAMS)
    assert isinstance(await anext(events), TextDelta) and session.feeds[-1].decodes == 0
    return events


async def test_a_turn_left_before_its_first_decode_settles_on_the_model_thread(make_engine, monkeypatch):
    # The caller leaves at the first streamed token: the turn's re-selection, still pending after its
    # prefill, moves bytes between the tiers, which only the model thread touches while steps run. It
    # settles there, while the session is free for its next turn at once.
    engine = make_engine(mode="tiered", token_budget=128, digest_read_whole=0)
    applied = []
    apply = ReselectTiered.apply

    def recording(self, layer, p):
        applied.append(threading.current_thread().name)
        return apply(self, layer, p)

    monkeypatch.setattr(ReselectTiered, "apply", recording)
    session = engine.create_session()
    await engine.complete(session.id, FIRST, PARAMS)
    applied.clear()
    events = await _leave_at_first_token(engine, session, LATER[0])
    assert not applied
    await events.aclose()
    assert not session.busy and session.turns[-1].finish_reason == "cancelled"  # free at once
    await engine.batcher.run(lambda: None)  # after the settle job (jobs run in order)
    await asyncio.sleep(0.05)  # its figures reach the loop
    assert applied and set(applied) == {"rkv-model"}, applied
    cache = session.cache
    assert session.turns[-1].device_bytes == cache.device_bytes()
    for layer in range(len(cache.layers)):
        assert torch.equal(positions_held(cache, layer, 0), torch.arange(cache.history_len)), layer

    # Left again, its settle job now queued behind a job holding the model thread; the next turn, sent
    # meanwhile, has its prefill (a step: steps alternate with jobs) run first, which settles the left
    # turn itself. The job must then leave the cache alone: an end_turn there would apply the new
    # turn's selection in the middle of it.
    events = await _leave_at_first_token(engine, session, LATER[1])
    hold = threading.Event()
    held = engine.batcher.submit(hold.wait)
    await events.aclose()
    ends = []
    end_turn = cache.end_turn
    cache.end_turn = lambda: ends.append(cache.history_len) or end_turn()
    fed = cache.history_len
    nxt = asyncio.create_task(engine.complete(session.id, LATER[2], PARAMS))
    for _ in range(500):
        if engine.batcher._prefills:
            break
        await asyncio.sleep(0.01)
    assert engine.batcher._prefills, "the next turn's prefill did not queue"
    hold.set()
    held.result(timeout=60)
    done = await nxt
    await engine.batcher.run(lambda: None)  # after the settle job
    assert ends == [], ends  # the job saw the next turn had begun
    assert done.usage.generated_tokens > 0 and cache.history_len > fed
    for layer in range(len(cache.layers)):
        assert torch.equal(positions_held(cache, layer, 0), torch.arange(cache.history_len)), layer


async def refuse_device(*args, **kwargs):
    raise DeviceMemoryExhausted("injected: no device memory for this turn")


async def test_a_left_turn_holds_its_host_room_until_its_settle_ends(make_engine, monkeypatch):
    # With no Redis to spill to, a turn holds host slots for the pages it may demote. A turn left at its
    # first token still demotes pages in its settle job; until that job ends its slots stay held, so no
    # other turn is admitted against room the settle is about to fill.
    engine = make_engine(mode="tiered", token_budget=128, digest_read_whole=0)
    session = engine.create_session()
    await engine.complete(session.id, FIRST, PARAMS)
    assert engine.host_tier.reserved_bytes() == 0
    events = await _leave_at_first_token(engine, session, LATER[0])
    held_in_turn = engine.host_tier.reserved_bytes()
    assert held_in_turn > 0
    hold = threading.Event()
    held = engine.batcher.submit(hold.wait)  # the settle job queues behind this one
    await events.aclose()
    assert not session.busy and session.turns[-1].finish_reason == "cancelled"  # free at once
    assert engine.host_tier.reserved_bytes() == held_in_turn
    # The client sends its next message at once, and it is refused (no device memory for it): the
    # settle's room stays held all the same.
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_admit_device", refuse_device)
        with pytest.raises(DeviceMemoryExhausted):
            await engine.chat(session.id, LATER[1], PARAMS)
    assert engine.host_tier.reserved_bytes() == held_in_turn
    hold.set()
    held.result(timeout=60)
    await engine.batcher.run(lambda: None)  # after the settle job (jobs run in order)
    for _ in range(100):  # its release reaches the loop
        if not engine.host_tier.reserved_bytes():
            break
        await asyncio.sleep(0.01)
    assert engine.host_tier.reserved_bytes() == 0
    assert session.turns[-1].device_bytes == session.cache.device_bytes()


def _fail_decode_sets(monkeypatch) -> None:
    """From now on a layer's decode set cannot be built: the last step of applying a re-selection fails,
    after its tokens moved, leaving the cache half-updated (``SessionCache.broken``)."""
    def failing(*args, **kwargs):
        raise RuntimeError("injected: the decode set could not be built")

    monkeypatch.setattr(HSADecode, "prepare", failing)


async def _rebuilt_from_history(engine, session) -> None:
    """The next turn runs on a new cache, prefilling the whole history, which every tier then holds once."""
    done = await engine.complete(session.id, LATER[2], PARAMS)
    assert done.usage.generated_tokens > 0 and done.usage.prefilled_tokens == done.usage.prompt_tokens
    cache = session.cache
    for layer in range(len(cache.layers)):
        assert torch.equal(positions_held(cache, layer, 0), torch.arange(cache.history_len)), layer


async def test_a_left_turns_settle_that_breaks_the_cache_drops_it(make_engine, monkeypatch):
    # The settle job of a turn left at its first token fails half-way through a layer's re-selection:
    # the half-updated cache goes at once (its cold pages freed), and no turn runs on it.
    engine = make_engine(mode="tiered", token_budget=128, digest_read_whole=0)
    session = engine.create_session()
    try:
        await engine.complete(session.id, FIRST, PARAMS)
        events = await _leave_at_first_token(engine, session, LATER[0])
        cache = session.cache
        _fail_decode_sets(monkeypatch)
        await events.aclose()
        await engine.batcher.run(lambda: None)  # after the settle job (jobs run in order)
        monkeypatch.undo()
        assert session.cache is None and cache.broken
        assert engine.host_tier.session_bytes(session.id) == 0
        await _rebuilt_from_history(engine, session)
    finally:
        await engine.delete_session(session.id)


async def test_a_persist_that_breaks_the_cache_drops_it(make_engine, redis_url, monkeypatch):
    # A persist settles what a left turn left pending; when that fails half-way, nothing is written
    # and the half-updated cache goes: the next turn rebuilds the session from its history.
    engine = make_engine(mode="tiered", token_budget=128, digest_read_whole=0, redis_url=redis_url,
                         redis_namespace=f"rkvtest-{secrets.token_hex(3)}")
    session = engine.create_session()
    try:
        await engine.complete(session.id, FIRST, PARAMS)
        events = await _leave_at_first_token(engine, session, LATER[0])
        cache = session.cache
        cache.end_turn = lambda: None  # the left turn's settle job leaves its re-selection to the persist
        await events.aclose()
        await engine.batcher.run(lambda: None)
        _fail_decode_sets(monkeypatch)
        assert await engine.persist(session.id) is None
        monkeypatch.undo()
        assert session.cache is None and cache.broken
        await _rebuilt_from_history(engine, session)
    finally:
        await engine.delete_session(session.id)


async def test_no_turn_runs_on_a_broken_cache(make_engine):
    # Broken after its turn was admitted (a job's failure the engine has not seen yet): the turn
    # rebuilds the session from its history instead.
    engine = make_engine(mode="tiered", token_budget=128)
    session = engine.create_session()
    try:
        await engine.complete(session.id, FIRST, PARAMS)
        broken = session.cache
        broken.broken = True
        await _rebuilt_from_history(engine, session)
        assert session.cache is not broken
    finally:
        await engine.delete_session(session.id)
