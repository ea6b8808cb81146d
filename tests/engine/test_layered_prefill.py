"""A long first prompt fed layer by layer through the engine (``app.engine.layer_prefill``): two of
them prefill together, their slices interleaved between another session's decode steps, within a
device budget of their bounds alone (no whole-prompt extra); stopped between two slices (a cancel, a
disconnect, a device-memory refusal), the session is as it was before the turn, and its next turn
goes as if the stopped one had never been sent."""
import asyncio
import time

import pytest
import torch

from app.engine import batcher as batcher_module
from app.engine.events import TurnDone
from app.engine.sampling import SamplingParams
from app.engine.steps import StepLog
import turn_helpers
from turn_helpers import message, reply_ids

pytestmark = pytest.mark.slow
CHUNK = 64
PARAMS = SamplingParams(max_tokens=8)


async def run_turn(engine, sid: str, text: str, params: SamplingParams = PARAMS) -> TurnDone:
    return await turn_helpers.run_turn(engine, sid, text, params)


async def test_two_long_first_prompts_prefill_together_within_their_bounds(make_engine, monkeypatch):
    monkeypatch.setattr(batcher_module, "ALONE_SLICE_S", 0.01)
    whole = make_engine(prefill_chunk=0)
    engine = make_engine(prefill_chunk=CHUNK)
    texts = [message(engine, 11, 230), message(engine, 12, 230)]
    want = []
    for text in texts:
        s = whole.create_session(mode="tiered", budget=64)
        want.append(reply_ids(s, await run_turn(whole, s.id, text)))

    a = engine.create_session(mode="rocketkv", budget=64)
    b, c = (engine.create_session(mode="tiered", budget=64) for _ in range(2))
    mem = engine.memory_account
    stream = SamplingParams(max_tokens=40)
    a_text = message(engine, 3, 30)
    needs = []
    for session, text, params in ((a, a_text, stream), (b, texts[0], PARAMS), (c, texts[1], PARAMS)):
        n = len(engine._turn_ids(session, text))
        needs.append(mem.turn_bound(session, n, params.max_tokens, prefill_chunk=CHUNK))
        # A first prompt fed layer by layer holds one layer of itself, as a whole prefill does: no extra.
        assert needs[-1] == mem.turn_bound(session, n, params.max_tokens)
    mem.budget = sum(needs) + 4096
    engine.batcher.step_log = StepLog()
    started = asyncio.Event()

    async def long_turn(session, text):
        await started.wait()
        return await run_turn(engine, session.id, text)

    a_done, b_done, c_done = await asyncio.gather(turn_helpers.stream(engine, a.id, a_text, stream, started, 2),
                                                  long_turn(b, texts[0]), long_turn(c, texts[1]))
    assert [reply_ids(b, b_done), reply_ids(c, c_done)] == want  # exactly a whole prefill's tokens
    assert a_done.usage.generated_tokens == 40
    # Each prompt's tokens count once (not once a layer).
    assert engine.batcher.stats.prefill_tokens == sum(d.usage.prefilled_tokens for d in (a_done, b_done, c_done))
    stats = engine.stats()
    assert stats["turns_refused_device_memory"] == 0 and stats["device_reservation_overruns"] == 0
    assert 0 < stats["peak_device_bytes"] <= mem.budget
    # The step log: b's and c's slices alternate while both are under way, with a's decode steps between.
    records = engine.batcher.step_log.since(0)
    order = [r.layered[0] for r in records if r.layered is not None]
    switches = sum(x != y for x, y in zip(order, order[1:]))
    assert {b.id, c.id} <= set(order) and switches >= 4, order
    first_c, last_b = order.index(c.id), len(order) - 1 - order[::-1].index(b.id)
    assert first_c < last_b  # c began before b had ended
    during = records[[i for i, r in enumerate(records) if r.layered is not None][0]:]
    assert any(r.decodes for r in during)
    assert all(r.layered[1] <= r.layered[2] for r in records if r.layered is not None)


@pytest.mark.parametrize("mode", ["rocketkv", "tiered"])
@pytest.mark.parametrize("how", ["cancel", "disconnect", "refusal"])
async def test_a_first_turn_stopped_between_slices_leaves_the_session_as_before(make_engine, monkeypatch, mode, how):
    monkeypatch.setattr(batcher_module, "ALONE_SLICE_S", 0.01)
    engine = make_engine(prefill_chunk=CHUNK, device_budget_bytes=8 * 1024**3)
    reference, stopped = (engine.create_session(mode=mode, budget=64) for _ in range(2))
    slices = engine.batcher.stats.layered_slices
    # After a few slices: some layers have selected (tiered: demoted to the host tier) by then.
    fired = await turn_helpers.stopped_turn(engine, stopped, message(engine, 5, 230), PARAMS, how, monkeypatch,
                                            lambda: engine.batcher.stats.layered_slices > slices + 3)
    stats = engine.batcher.stats
    # (A refusal comes on its own: the reservation is outgrown by the first slice.)
    assert (fired or how == "refusal") and stats.prefills_stopped == 1 and stats.prefills == 0
    assert stats.layered_slices > slices
    assert not stopped.busy and stopped.id not in engine.memory_account.reserved
    assert stopped.messages == [] and stopped.token_ids == []
    cache = stopped.cache
    assert cache.history_len == 0 and cache.device_bytes() == 0
    assert cache.tier_bytes() == {"device": 0, "host": 0, "redis": 0}
    assert engine.memory_account.held[stopped.id] == 0

    # The next turn goes exactly as the same first turn of a session that never saw the stopped one.
    text = message(engine, 7, 230)
    done_ref = await run_turn(engine, reference.id, text)
    done_stopped = await run_turn(engine, stopped.id, text)
    assert reply_ids(stopped, done_stopped) == reply_ids(reference, done_ref)
    assert done_stopped.usage == done_ref.usage
    assert stopped.cache.kept_tokens() == reference.cache.kept_tokens()
    for x, y in zip(stopped.cache.layers, reference.cache.layers):
        assert torch.equal(x.positions, y.positions)


async def test_a_first_turn_cancelled_before_its_first_slice_never_runs(make_engine):
    engine = make_engine(prefill_chunk=CHUNK)
    session = engine.create_session(mode="tiered", budget=64)
    engine.batcher.submit(lambda: time.sleep(1.0))  # the model thread is busy when the turn arrives
    task = asyncio.ensure_future(run_turn(engine, session.id, message(engine, 5, 230)))
    await asyncio.sleep(0.3)
    engine.cancel(session.id)
    done = await task
    stats = engine.batcher.stats
    assert done.finish_reason == "cancelled" and done.usage.generated_tokens == 0
    assert stats.layered_slices == 0 and stats.prefills_stopped == 1 and stats.prefills == 0
    assert session.messages == [] and session.token_ids == [] and session.cache.history_len == 0
    assert not session.busy and session.id not in engine.memory_account.reserved


async def test_a_model_not_of_llama_layout_feeds_a_first_prompt_in_chunks(make_engine):
    engine = make_engine(prefill_chunk=CHUNK)
    engine.runner.layerable = engine.memory_account.layered = False  # as ModelRunner says for such a model
    session = engine.create_session(mode="rocketkv", budget=64)
    text = message(engine, 5, 230)
    n = len(engine._turn_ids(session, text))
    mem = engine.memory_account
    assert mem.turn_bound(session, n, 8, prefill_chunk=CHUNK) > mem.turn_bound(session, n, 8)  # the chunks' extra
    done = await run_turn(engine, session.id, text)
    stats = engine.batcher.stats
    assert done.usage.generated_tokens > 0 and stats.layered_slices == 0 and stats.prefill_chunks >= 3
