"""A long later message of a ``tiered`` session with cold pages, fed layer by layer through the engine
(``app.engine.layer_prefill``, keys first): the same replies as a whole prefill, in slices between other
sessions' steps; stopped between two slices (a cancel, a disconnect, a device-memory refusal), the turn
is undone, the session keeps its history and its next turn rebuilds the cache and goes as if the stopped
one had never been sent."""
import asyncio
import threading

import pytest
import torch

from app.engine import batcher as batcher_module
from app.engine.errors import HostMemoryExhausted
from app.engine.layer_prefill import LayerPrefill
from app.engine.sampling import SamplingParams
from rocketkv_mt.cache.prefill.tiered.policy import ReselectTiered
from tiers.host.tier import HostFull
import turn_helpers
from turn_helpers import message, reply_ids

pytestmark = pytest.mark.slow
CHUNK = 64
PARAMS = SamplingParams(max_tokens=8)


async def run_turn(engine, sid, text):
    return await turn_helpers.run_turn(engine, sid, text, PARAMS)


async def with_cold_pages(engine, session) -> None:
    await run_turn(engine, session.id, message(engine, 21, 230))
    assert session.cache.cold_pages() > 0 and session.cache.layers_later()


async def three_sessions(engine, seed: int):
    """A long later message (seed ``seed``), a reference session with cold pages that has had it, a
    second one with cold pages that has not, and a third to stream: (message, the three, the
    reference's turn)."""
    later = message(engine, seed, 230)
    reference, other, streaming = (engine.create_session(mode="tiered", budget=64) for _ in range(3))
    for session in (reference, other):
        await with_cold_pages(engine, session)
    return later, reference, other, streaming, await run_turn(engine, reference.id, later)


def hold_last_layer(monkeypatch, cache) -> tuple[threading.Event, threading.Event]:
    """From now on the cache's last layer, when it applies its choice, waits for the returned gate;
    the other event tells that it has begun."""
    last = cache.spec.num_layers - 1
    gate, applying = threading.Event(), threading.Event()
    apply = ReselectTiered.apply

    def gated(policy, layer, pending):
        if policy.cache is cache and layer == last:
            applying.set()
            assert gate.wait(60)
        apply(policy, layer, pending)

    monkeypatch.setattr(ReselectTiered, "apply", gated)
    return gate, applying


async def streaming_beside(engine, session, seed: int) -> asyncio.Future:
    """A long reply streaming in ``session``, once its first token is out."""
    started = asyncio.Event()
    streams = asyncio.ensure_future(turn_helpers.stream(engine, session.id, message(engine, seed, 40),
                                                        SamplingParams(max_tokens=400), started, 1))
    await started.wait()
    return streams


async def test_a_long_later_message_is_fed_layer_by_layer_as_a_whole_prefill_would(make_engine):
    whole, engine = make_engine(prefill_chunk=0), make_engine(prefill_chunk=CHUNK)
    later, third = message(engine, 22, 230), "And in one word?"
    replies = []
    for e in (whole, engine):
        session = e.create_session(mode="tiered", budget=64)
        await with_cold_pages(e, session)
        slices = e.batcher.stats.layered_slices
        done = await run_turn(e, session.id, later)
        replies.append((reply_ids(session, done), reply_ids(session, await run_turn(e, session.id, third)),
                        [store.positions for store in session.cache.layers], e.batcher.stats.layered_slices - slices))
    (a, a3, a_pos, a_slices), (b, b3, b_pos, b_slices) = replies
    assert a_slices == 0 and b_slices > 1  # the whole engine fed it in one step; this one layer by layer
    assert a == b and a3 == b3
    for x, y in zip(a_pos, b_pos):
        assert torch.equal(x, y)
    stats = engine.stats()
    assert stats["device_reservation_overruns"] == 0


async def test_while_the_next_layer_is_not_ready_the_streams_go_on_and_the_message_is_the_same(make_engine,
                                                                                               monkeypatch):
    """A long later message whose next layer is not ready (the layer before still applies its choice on
    the page reader; here said so for two thirds of the asks) gives its slice up to the streaming
    sessions' steps: the message's reply and kept positions are those of a message never put off."""
    engine = make_engine(prefill_chunk=CHUNK)
    later, reference, deferred, streaming, done_ref = await three_sessions(engine, 24)
    ready, asks = LayerPrefill.ready, []
    monkeypatch.setattr(LayerPrefill, "ready", lambda plan: bool(asks.append(1)) or len(asks) % 3 == 0 and ready(plan))
    streams = await streaming_beside(engine, streaming, 25)
    steps = engine.batcher.stats.decode_steps
    done = await run_turn(engine, deferred.id, later)
    assert engine.batcher.stats.layered_deferred > 0
    assert engine.batcher.stats.decode_steps > steps  # the stream went on meanwhile
    await streams
    assert reply_ids(deferred, done) == reply_ids(reference, done_ref)
    for x, y in zip(deferred.cache.layers, reference.cache.layers):
        assert torch.equal(x.positions, y.positions)


async def test_the_message_s_decode_waits_for_its_last_layer_while_the_streams_go_on(make_engine, monkeypatch):
    """On a CPU the last layer applies its choice on the page reader too, after the first token is out:
    the message's next decode step is held back until that is done (here: until the test lets it), the
    streaming session steps meanwhile, and the reply and kept positions are a reference turn's."""
    engine = make_engine(prefill_chunk=CHUNK)
    later, reference, held, streaming, done_ref = await three_sessions(engine, 26)
    gate, applying = hold_last_layer(monkeypatch, held.cache)
    first = asyncio.Event()
    streams = await streaming_beside(engine, streaming, 27)
    turn = asyncio.ensure_future(turn_helpers.stream(engine, held.id, later, PARAMS, first, 1))
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, applying.wait, 30)
        await asyncio.wait_for(first.wait(), 30)  # the first token is out while the last layer is held
        steps = engine.batcher.stats.decode_steps
        await asyncio.sleep(0.5)
        assert not held.cache.decode_ready() and not turn.done()
        assert engine.batcher.stats.decode_steps > steps  # the stream went on meanwhile
    finally:
        gate.set()
    done = await turn
    await streams
    assert reply_ids(held, done) == reply_ids(reference, done_ref)
    for x, y in zip(held.cache.layers, reference.cache.layers):
        assert torch.equal(x.positions, y.positions)


async def test_a_reply_ended_at_its_first_token_settles_without_stopping_the_streams(make_engine, monkeypatch):
    """A one-token reply ends before any decode step, so the job that settles its turn runs on the model
    thread; while its last layer still applies on the page reader (held here), that job waits off the
    model thread, and the streaming session steps on; once the layer is applied the job runs."""
    engine = make_engine(prefill_chunk=CHUNK)
    later, _, held, streaming, _ = await three_sessions(engine, 28)
    gate, applying = hold_last_layer(monkeypatch, held.cache)
    streams = await streaming_beside(engine, streaming, 29)
    turn = asyncio.ensure_future(turn_helpers.run_turn(engine, held.id, later, SamplingParams(max_tokens=1)))
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, applying.wait, 30)
        await asyncio.sleep(0.3)  # the first token is out and the turn's settle job queued
        steps = engine.batcher.stats.decode_steps
        await asyncio.sleep(0.5)
        assert engine.batcher.stats.decode_steps > steps  # the stream went on meanwhile
        assert not held.cache.decode_ready() and not turn.done()
    finally:
        gate.set()
    done = await turn
    await streams
    assert done.usage.generated_tokens == 1 and held.cache.decode_ready()
    assert held.cache.history_len == held.fed_tokens


async def test_a_host_tier_failure_in_the_last_layer_after_the_first_token_ends_the_turn_as_an_error(
        make_engine, monkeypatch):
    """The last layer's application runs on the page reader after the first token is out; when the host
    tier fills up there (Redis gone since admission), the turn ends with ``host_memory_exhausted`` after
    its first token rather than being refused whole: the cache is dropped, the message and an empty,
    closed reply stay in the history, and the next turn rebuilds the cache from it."""
    engine = make_engine(prefill_chunk=CHUNK)
    later, _, held, _, _ = await three_sessions(engine, 30)
    last = held.cache.spec.num_layers - 1
    apply = ReselectTiered.apply

    def failing(policy, layer, pending):
        if policy.cache is held.cache and layer == last:
            raise HostFull("injected: no free host slot and nothing can spill")
        apply(policy, layer, pending)

    monkeypatch.setattr(ReselectTiered, "apply", failing)
    events = await engine.chat(held.id, later, PARAMS)
    with pytest.raises(HostMemoryExhausted, match="the turn was stopped"):
        async for _ in events:
            pass
    assert held.feeds[-1].prefill > 0 and held.cache is None and not held.busy
    assert held.messages[-2] == {"role": "user", "content": later}
    assert held.messages[-1]["error"] and held.messages[-1]["closed"]
    assert engine.host_tier.reserved_bytes() == 0
    monkeypatch.undo()
    done = await run_turn(engine, held.id, "And in one word?")
    assert done.usage.generated_tokens > 0 and done.usage.prefilled_tokens == done.usage.prompt_tokens


@pytest.mark.parametrize("how", ["cancel", "disconnect", "refusal"])
async def test_a_later_message_stopped_between_slices_leaves_the_history_as_before(make_engine, monkeypatch, how):
    monkeypatch.setattr(batcher_module, "ALONE_SLICE_S", 0.01)
    engine = make_engine(prefill_chunk=CHUNK, device_budget_bytes=8 * 1024**3)
    reference, stopped = (engine.create_session(mode="tiered", budget=64) for _ in range(2))
    for session in (reference, stopped):
        await with_cold_pages(engine, session)
    messages, token_ids, fed = list(stopped.messages), list(stopped.token_ids), stopped.cache.history_len
    slices = engine.batcher.stats.layered_slices
    later = message(engine, 23, 230)
    # After a few slices: some layers have re-selected (demoted to and promoted from the cold tiers).
    fired = await turn_helpers.stopped_turn(engine, stopped, later, PARAMS, how, monkeypatch,
                                            lambda: engine.batcher.stats.layered_slices > slices + 3)
    assert (fired or how == "refusal") and engine.batcher.stats.prefills_stopped == 1
    assert not stopped.busy and stopped.id not in engine.memory_account.reserved
    assert stopped.messages == messages and stopped.token_ids == token_ids
    assert stopped.cache.history_len == fed
    if how != "refusal":  # (a refusal comes before the first slice: the cache is untouched)
        # Half re-selected, the cache cannot be taken back: it is released and rebuilt from the history.
        assert stopped.cache.broken
        assert stopped.cache.device_bytes() == 0 and stopped.cache.tier_bytes()["host"] == 0

    # The same message again goes exactly as in a session that never saw the stopped one.
    done_ref = await run_turn(engine, reference.id, later)
    done_stopped = await run_turn(engine, stopped.id, later)
    assert reply_ids(stopped, done_stopped) == reply_ids(reference, done_ref)
    assert stopped.cache.kept_tokens() == reference.cache.kept_tokens()
    for x, y in zip(stopped.cache.layers, reference.cache.layers):
        assert torch.equal(x.positions, y.positions)
