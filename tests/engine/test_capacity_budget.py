"""Device-memory budget per replica: turns are admitted within it, idle sessions are parked off the
device to make room (and come back with the same replies), turns that cannot fit are refused."""
import asyncio
import copy
import secrets

import pytest

from app.engine.errors import DeviceMemoryExhausted
from app.engine.sampling import SamplingParams
from bench.common import fit_words
from bench.haystack import filler_text

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8)


def message(engine, seed: int, words: int = 260) -> str:
    return fit_words(engine.tokenizer, filler_text(words, seed=seed), words) + "\n\nWhat is this about?"


def bound_of_first_turn(engine, mode: str, text: str) -> int:
    probe = engine.create_session(mode=mode, budget=64)
    n = len(engine._turn_ids(probe, text))
    bound = engine.memory_account.turn_bound(probe, n, PARAMS.max_tokens)
    engine.drop(probe.id)
    return bound


def assert_within_budget(engine):
    stats = engine.stats()
    assert 0 < stats["peak_device_bytes"] <= stats["device_budget_bytes"]
    assert stats["device_reservation_overruns"] == 0


async def test_parking_keeps_the_budget_and_parked_sessions_continue_the_same(make_engine):
    ref = make_engine(mode="full")
    texts = {name: message(ref, seed) for seed, name in enumerate("abc")}
    budget = int(2.5 * bound_of_first_turn(ref, "full", texts["a"]))  # room for two such sessions, not three
    engine = make_engine(mode="full", device_budget_bytes=budget)
    ours = {name: engine.create_session(budget=64) for name in "abc"}
    theirs = {name: ref.create_session(budget=64) for name in "abc"}
    for name in "abc":
        await engine.complete(ours[name].id, texts[name], PARAMS)
        await ref.complete(theirs[name].id, texts[name], PARAMS)
    assert engine.memory_account.parks == 1 and ours["a"].cache is None  # the least recently used
    assert ours["b"].cache is not None and ours["c"].cache is not None
    done = await engine.complete(ours["a"].id, "And in one word?", PARAMS)
    expected = await ref.complete(theirs["a"].id, "And in one word?", PARAMS)
    assert done.text == expected.text
    assert done.usage.prefilled_tokens == done.usage.prompt_tokens  # full mode: re-prefilled after parking
    assert engine.memory_account.parks == 2 and ours["b"].cache is None
    assert_within_budget(engine)


async def test_turn_that_cannot_fit_is_refused_and_the_session_is_unchanged(make_engine):
    probe = make_engine(mode="full")
    text = message(probe, 1)
    bound = bound_of_first_turn(probe, "full", text)
    engine = make_engine(mode="full", device_budget_bytes=int(1.5 * bound))
    first = engine.create_session()
    await engine.complete(first.id, text, PARAMS)
    # Too big for the budget on its own: refused, whatever could be parked.
    big = engine.create_session()
    before = (copy.deepcopy(big.messages), list(big.token_ids), big.busy)
    with pytest.raises(DeviceMemoryExhausted) as err:
        await engine.chat(big.id, message(engine, 2, words=900), PARAMS)
    assert err.value.code == "device_memory_exhausted"
    assert (big.messages, big.token_ids, big.busy) == before
    assert first.cache is not None  # nothing was parked for a turn that could not fit anyway
    # Fits only by parking, and parking is off: refused; on: admitted.
    engine.parking = False
    second = engine.create_session()
    with pytest.raises(DeviceMemoryExhausted):
        await engine.chat(second.id, message(engine, 3), PARAMS)
    engine.parking = True
    done = await engine.complete(second.id, message(engine, 3), PARAMS)
    assert done.usage.generated_tokens > 0 and first.cache is None
    assert engine.memory_account.refusals == 2
    assert_within_budget(engine)


@pytest.mark.parametrize("wait_s", [60.0, 0.0])
async def test_a_turn_waits_for_the_room_a_turn_in_flight_holds(make_engine, wait_s):
    probe = make_engine(mode="full")
    text = message(probe, 1)
    bound = bound_of_first_turn(probe, "full", text)
    engine = make_engine(mode="full", device_budget_bytes=int(1.5 * bound), admission_wait_s=wait_s)
    first, second = engine.create_session(), engine.create_session()
    await engine.complete(first.id, text, PARAMS)
    ended = []

    async def go_on():
        async for _ in await engine.chat(first.id, "Go on.", SamplingParams(max_tokens=24)):
            pass
        ended.append("first")

    in_flight = asyncio.create_task(go_on())
    await asyncio.sleep(0)  # the first session's turn is admitted and holds its reservation
    assert first.busy
    before = (copy.deepcopy(second.messages), list(second.token_ids))
    if wait_s == 0:
        # Refused at once, as it always was: nothing changed.
        with pytest.raises(DeviceMemoryExhausted):
            await engine.chat(second.id, message(engine, 3), PARAMS)
        assert (second.messages, second.token_ids, second.busy) == (*before, False)
        await in_flight
        assert engine.memory_account.refusals == 1
        return
    # It does not fit beside the turn in flight (which cannot be parked): it waits, then parks the
    # first session, now idle, and runs.
    async def second_turn():
        done = await engine.complete(second.id, message(engine, 3), PARAMS)
        ended.append("second")
        return done

    waiting = asyncio.create_task(second_turn())
    while not len(engine.admissions):
        await asyncio.sleep(0)
    # A turn larger than the whole budget, arriving behind it, is refused at once with the structured error.
    big = engine.create_session()
    with pytest.raises(DeviceMemoryExhausted, match="needs up to"):
        await engine.chat(big.id, message(engine, 2, words=900), PARAMS)
    assert not big.busy and not big.token_ids
    done = await waiting
    await in_flight
    assert ended == ["first", "second"] and done.usage.generated_tokens > 0
    assert first.cache is None and engine.memory_account.parks == 1 and engine.memory_account.refusals == 1
    assert_within_budget(engine)


async def test_parked_tiered_session_comes_back_from_redis_without_reprefill(make_engine, redis_url):
    namespace = f"rkvtest-{secrets.token_hex(3)}"
    # Whole prefills: a chunked one's bound holds every new token in every layer at once.
    ref = make_engine(mode="tiered", prefill_chunk=0)
    text_a, text_b = message(ref, 4, words=500), message(ref, 5, words=500)
    ra = ref.create_session(budget=64)
    await ref.complete(ra.id, text_a, PARAMS)
    follow_up = len(ref._turn_ids(ra, "Say that again."))
    # The largest budget that admits b's first turn only once a is parked; a's next turn (which reads
    # its cold pages back) must then fit on its own.
    budget = ra.cache.device_bytes() + bound_of_first_turn(ref, "tiered", text_b) - 1
    resident_bound = ref.memory_account.turn_bound(ra, follow_up, PARAMS.max_tokens)
    assert resident_bound <= budget
    engine = make_engine(
        mode="tiered", prefill_chunk=0, device_budget_bytes=budget, redis_url=redis_url, redis_namespace=namespace
    )
    a, b = engine.create_session(budget=64), engine.create_session(budget=64)
    try:
        await engine.complete(a.id, text_a, PARAMS)
        await engine.complete(b.id, text_b, PARAMS)
        assert a.cache is None and engine.memory_account.parks == 1
        # Its KV record says how many cold pages it has: its next turn is bounded as when it was resident.
        assert engine.memory_account.turn_bound(a, follow_up, PARAMS.max_tokens) == resident_bound
        done = await engine.complete(a.id, "Say that again.", PARAMS)
        expected = await ref.complete(ra.id, "Say that again.", PARAMS)
        assert done.text == expected.text
        assert done.usage.prefilled_tokens == expected.usage.prefilled_tokens < 40  # restored, not re-prefilled
        assert b.cache is None and engine.memory_account.parks == 2
        assert_within_budget(engine)
    finally:
        for s in (a, b):
            await engine.delete_session(s.id)
