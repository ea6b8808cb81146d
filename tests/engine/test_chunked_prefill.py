"""Chunked prefill (``RKV_PREFILL_CHUNK``): a long later prefill runs as several steps that also carry
the other sessions' decode tokens (a long first prompt is fed layer by layer instead:
tests/engine/test_layered_prefill.py); every mode gives the same tokens and the same cache as a
whole prefill; stopped between two chunks (a cancel, a disconnect, a device-memory refusal), the
session is exactly as it was before the turn."""
import asyncio
from collections import deque

import pytest
import torch

from app.engine import batcher as batcher_module
from app.engine.events import TextDelta, TurnDone
from app.engine.sampling import SamplingParams
from app.engine.steps import RecentMedian, Request, chunk_budget, take
import turn_helpers
from turn_helpers import message, reply_ids

CHUNK = 64
MODES = ["full", "snapkv", "rocketkv", "rocketkv-mt", "tiered"]
PARAMS = SamplingParams(max_tokens=10)


async def run_turn(engine, sid: str, text: str, params: SamplingParams = PARAMS) -> TurnDone:
    return await turn_helpers.run_turn(engine, sid, text, params)


def by_position(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's kept positions and their keys, each head in position order (slot order may differ:
    tiered re-admits tokens in the order of the pages it read)."""
    pos, order = layer.positions.sort(dim=1)
    return pos.clone(), torch.gather(layer.keys, 1, order.unsqueeze(-1).expand_as(layer.keys)).clone()


def cache_state(session) -> tuple:
    cache = session.cache
    return cache.history_len, cache.kept_tokens(), cache.device_bytes()


# --- what a step takes (pure logic) ------------------------------------------------------------
class _Cache:
    def __init__(self, last: int | None):
        self.last = last

    def last_chunk_min(self) -> int | None:
        return self.last


def _prefill(n: int, last: int | None = 32) -> Request:
    return Request("s", _Cache(last), list(range(n)), prefill=True)


def _feed(prefills: deque, budget: int, chunking: bool = True) -> list[list[int]]:
    """Run steps until the queue is empty; each step's prefill segment lengths."""
    steps = []
    while prefills:
        batch = take([], prefills, budget, chunking)
        for req, segment in batch:
            req.fed += len(segment.ids)
        steps.append([len(s.ids) for _, s in batch])
    return steps


def test_a_step_takes_chunks_up_to_its_budget_and_keeps_a_whole_window_last():
    assert _feed(deque([_prefill(300)]), 64) == [[64], [64], [64], [64], [44]]
    # The last chunk keeps the window (32) whole: 100 = 64 + 36, 90 = 58 + 32.
    assert _feed(deque([_prefill(100)]), 64) == [[64], [36]]
    assert _feed(deque([_prefill(90)]), 64) == [[58], [32]]
    # Short prefills share a step; a long one fills what is left, then keeps the head of the queue.
    assert _feed(deque([_prefill(20), _prefill(30), _prefill(200)]), 64) == [[20, 30, 14], [64], [64], [58]]
    # A cache that cannot split its prefill is fed whole, as the first prefill of a step.
    assert _feed(deque([_prefill(20), _prefill(300, last=None)]), 64) == [[20], [300]]
    # Without chunking: the first prefill whole, later ones only if they fit in the budget.
    assert _feed(deque([_prefill(300), _prefill(100), _prefill(600)]), 512, chunking=False) == [[300, 100], [600]]


def test_a_step_that_ends_a_chunked_prefill_starts_no_other_in_part():
    ending, waiting, short = _prefill(100), _prefill(300), _prefill(20)
    ending.fed = 64  # its last 36 tokens are left
    batch = take([], deque([ending, waiting]), 64, chunking=True)
    assert [len(seg.ids) for _, seg in batch] == [36]  # the next one's chunks start in a later step
    ending.fed = 64
    batch = take([], deque([ending, short, waiting]), 64, chunking=True)
    assert [len(seg.ids) for _, seg in batch] == [36, 20]  # a whole short prefill still fills the step


def test_decode_tokens_of_other_sessions_ride_along():
    decodes = [Request("a", _Cache(32), [7]), Request("b", _Cache(32), [8])]
    prefills = deque([_prefill(300)])
    batch = take(decodes, prefills, 64, chunking=True)
    assert [(r.key, len(s.ids), s.prefill, s.rest) for r, s in batch] == [
        ("a", 1, False, 0), ("b", 1, False, 0), ("s", 64, True, 236)
    ]
    assert list(prefills) == [batch[-1][0]]  # fed in part: still first in the queue


def test_the_reference_decode_step_ignores_a_few_slow_steps():
    ref = RecentMedian(5)
    assert ref.value == 0.0  # nothing timed yet: chunk_budget gives its floor
    for s in (0.045, 0.046, 0.044):
        ref.add(s)
    ref.add(0.093)
    ref.add(0.074)  # two steps slowed just before a long message's first chunk
    assert ref.value == 0.046
    for s in (0.06, 0.061, 0.062):  # histories grew: the reference follows once most steps are slower
        ref.add(s)
    assert ref.value == 0.062


def test_a_chunk_beside_decode_tokens_adds_about_one_decode_step():
    # 0.2 s decode steps, 5 ms a prefill token: 40 tokens; within [16, 512].
    assert chunk_budget(0.2, 0.005, 512, 16) == 40
    assert chunk_budget(0.2, 0.05, 512, 16) == 16  # a long history: never below the floor
    assert chunk_budget(0.2, 0.0001, 512, 16) == 512  # a cheap prefill: the whole chunk
    assert chunk_budget(0.2, None, 512, 16) == 16  # no chunk fed yet
    assert chunk_budget(0.0, 0.005, 512, 16) == 16  # no decode step timed yet
    # After a chunk of 20: at most 1.5x that, however cheap the last chunks looked; never below the floor.
    assert chunk_budget(0.2, 0.0001, 512, 16, last=20) == 30
    assert chunk_budget(0.2, 0.005, 512, 16, last=20) == 30
    assert chunk_budget(0.2, 0.005, 512, 16, last=40) == 40
    assert chunk_budget(0.2, 0.005, 512, 16, last=4) == 16


# --- the engine ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode,reselect", [(m, "exhaustive") for m in MODES] + [("tiered", "digest")])
async def test_chunked_prefill_gives_the_tokens_and_cache_of_a_whole_one(make_engine, mode, reselect):
    """The same replies, and the same tokens kept with the same keys. With ``digest`` re-selection a
    later turn reads the cold pages whose bounds rank highest, a discrete choice that the chunks' float
    rounding can tip where two pages nearly tie (and pages grouped by keys split at medians that it can
    move), so the later turn's tokens may attend over other pages: that case is held to the same
    replies only."""
    results, overruns = [], []
    for chunk in (0, CHUNK):
        engine = make_engine(prefill_chunk=chunk, reselect=reselect)
        session = engine.create_session(mode=mode, budget=64)
        turns = []
        for seed, words in ((1, 230), (2, 80)):  # ~266 and ~96 new tokens
            done = await run_turn(engine, session.id, message(engine, seed, words))
            turns.append((reply_ids(session, done), done.usage, done.text))
        results.append((turns, cache_state(session), [by_position(layer) for layer in session.cache.layers]))
        overruns.append(engine.memory_account.overruns)
        stats = engine.batcher.stats
        if chunk:
            # The first turn was fed layer by layer; the second in 2 chunks, except tiered's (it then reads
            # cold pages, and is fed whole).
            assert stats.prefill_chunks == (0 if mode == "tiered" else 1) and stats.layered_slices >= 1
        else:
            assert stats.prefill_chunks == 0 and stats.layered_slices == 0
    assert overruns[1] <= overruns[0]  # the chunks stayed within what their turns reserved
    (whole, whole_cache, whole_keys), (chunked, chunked_cache, chunked_keys) = results
    assert chunked == whole
    assert all(len(ids) > 0 for ids, _, _ in whole)
    if reselect == "digest":
        return
    assert chunked_cache == whole_cache
    for (pos_a, keys_a), (pos_b, keys_b) in zip(whole_keys, chunked_keys):
        assert torch.equal(pos_a, pos_b)  # the same tokens kept, in every layer and head
        torch.testing.assert_close(keys_a, keys_b, atol=1e-4, rtol=0)
    if mode not in ("full", "rocketkv-mt"):  # (rocketkv-mt keeps the whole history too)
        assert whole_cache[1] < whole_cache[0]  # Stage 1 did compress


@pytest.mark.slow
async def test_decode_goes_on_in_the_steps_that_feed_a_long_prefill(make_engine, monkeypatch):
    # One layer's selection per slice: the long prefill's end of prefill runs between the other's steps.
    monkeypatch.setattr(batcher_module, "SELECT_FRACTION", 0.0)
    monkeypatch.setattr(batcher_module, "SELECT_MIN_S", 0.0)
    # Chunk sizes beside decode tokens come from measured step times: fixed here, so the test is exact.
    budgets = []

    def fixed_budget(decode_s, token_s, most, least, last=0):
        budgets.append((decode_s, token_s))
        return 20

    monkeypatch.setattr(batcher_module, "chunk_budget", fixed_budget)
    alone_engine = make_engine(prefill_chunk=CHUNK)
    engine = make_engine(prefill_chunk=CHUNK)
    long_reply = SamplingParams(max_tokens=40)
    alone = []
    for e in (alone_engine, engine):
        sessions = [e.create_session(mode="rocketkv", budget=64) for _ in range(2)]
        first = message(e, 3, 40)
        await run_turn(e, sessions[1].id, message(e, 6, 20))  # b's long message is a later turn: chunked
        alone.append((sessions, first))
    sessions, first = alone[0]
    a_done = await run_turn(alone_engine, sessions[0].id, first, long_reply)
    b_done = await run_turn(alone_engine, sessions[1].id, message(alone_engine, 4, 230))
    want = (reply_ids(sessions[0], a_done), reply_ids(sessions[1], b_done))

    sessions, first = alone[1]
    a, b = sessions
    steps: list[list[str]] = []
    after_step = engine.batcher.on_step
    engine.batcher.on_step = lambda keys: (steps.append(keys), after_step(keys))
    segments: list[list[tuple]] = []  # per step: (cache, prefill, tokens) of each segment
    run_step = engine.runner.step
    engine.runner.step = lambda segs: (segments.append([(g.cache, g.prefill, len(g.ids)) for g in segs]), run_step(segs))[1]
    started = asyncio.Event()

    async def long_prefill():
        await started.wait()
        return await run_turn(engine, b.id, message(engine, 4, 230))

    a_done, b_done = await asyncio.gather(turn_helpers.stream(engine, a.id, first, long_reply, started, 3),
                                          long_prefill())
    assert (reply_ids(a, a_done), reply_ids(b, b_done)) == want
    with_b = [keys for keys in steps if b.id in keys]
    assert len(with_b) >= 6  # 5 prefill steps and decode
    # The steps that fed the prefill carried the other session's next token too (one may have missed
    # it on a loaded machine: a step waits for a generating session only briefly).
    assert sum(a.id in keys for keys in with_b[:5]) >= 4
    assert engine.batcher.stats.prefill_chunks >= 4
    # After its last chunk, b's layers selected one per slice while a's decode steps went on without b,
    # and b's reply is still the one of a prefill that selected in its last forward.
    b_prefill = [i for i, segs in enumerate(segments) if any(cache is b.cache and prefill for cache, prefill, _ in segs)]
    b_decode = [i for i, segs in enumerate(segments) if any(cache is b.cache and not prefill for cache, prefill, _ in segs)]
    between = segments[b_prefill[-1] + 1 : b_decode[0]]
    assert between and all([cache for cache, _, _ in segs] == [a.cache] for segs in between)
    assert 2 <= engine.batcher.stats.selection_slices <= len(b.cache.layers)
    # Beside a's decode tokens, b's chunks were cut to ``chunk_budget``'s size, given the time of a's
    # decode steps once one was timed and of b's last chunk once fed; the last one too, though shorter
    # than Stage 1's window (the window's queries are gathered over the chunks).
    b_chunks = [n for segs in segments for cache, prefill, n in segs if cache is b.cache and prefill]
    assert all(n <= 20 for n in b_chunks)
    assert all(decode_s > 0 and token_s > 0 for decode_s, token_s in budgets[1:])


@pytest.mark.slow
async def test_a_chunked_prefill_starts_only_after_the_one_before_it_has_selected(make_engine, monkeypatch):
    """One prefill's uncompressed chunks sit in the layers at a time, as the device budget assumes:
    a second long prefill's first chunk waits until the first one's deferred selection is done."""
    monkeypatch.setattr(batcher_module, "SELECT_FRACTION", 0.0)  # the first one's selection would take many slices
    monkeypatch.setattr(batcher_module, "SELECT_MIN_S", 0.0)
    engine = make_engine(prefill_chunk=CHUNK)
    a, b, c = (engine.create_session(mode="rocketkv", budget=64) for _ in range(3))
    for session in (b, c):  # their long messages are later turns: chunked
        await run_turn(engine, session.id, message(engine, 6, 20))
    seen = []  # b's unselected layers when each of c's chunks ran
    run_step = engine.runner.step

    def step(segs):
        if any(g.cache is c.cache and g.prefill for g in segs):
            seen.append(b.cache.unselected_layers())
        return run_step(segs)

    engine.runner.step = step
    started = asyncio.Event()

    async def streaming():
        deltas = 0
        async for event in await engine.chat(a.id, message(engine, 3, 40), SamplingParams(max_tokens=60)):
            if isinstance(event, TextDelta):
                deltas += 1
                if deltas == 3:
                    started.set()

    async def long_turn(session, seed):
        await started.wait()
        return await run_turn(engine, session.id, message(engine, seed, 230))

    await asyncio.gather(streaming(), long_turn(b, 4), long_turn(c, 5))
    assert len(seen) > 1 and all(n == 0 for n in seen)


@pytest.mark.slow
async def test_chunked_prefills_share_one_extra_in_the_device_budget(make_engine):
    """Prefills are fed in chunks one at a time, so two turns that arrive together need their bounds
    plus one chunking extra (every new token in every layer until the last chunk), not two."""
    engine = make_engine(prefill_chunk=CHUNK)
    a, b = (engine.create_session(mode="rocketkv", budget=64) for _ in range(2))
    for session in (a, b):  # their long messages are later turns: chunked
        await run_turn(engine, session.id, message(engine, 6, 20))
    engine.memory_account.budget = 1
    texts = [message(engine, 8, 230), message(engine, 9, 230)]
    mem = engine.memory_account
    needs, extras, fed = [], [], 0
    for session, text in zip((a, b), texts):
        n = len(engine._turn_ids(session, text))
        fed += n
        needs.append(mem.turn_bound(session, n, PARAMS.max_tokens))
        extras.append(mem.turn_bound(session, n, PARAMS.max_tokens, prefill_chunk=CHUNK) - needs[-1])
    assert min(extras) > 0
    mem.budget = sum(needs) + max(extras) + 4096
    assert mem.budget < sum(needs) + sum(extras)
    done = await asyncio.gather(*(run_turn(engine, s.id, t) for s, t in zip((a, b), texts)))
    assert all(d.usage.generated_tokens > 0 for d in done)
    stats = engine.stats()
    assert stats["turns_refused_device_memory"] == 0 and stats["device_reservation_overruns"] == 0
    assert 0 < stats["peak_device_bytes"] <= mem.budget
    # At most CHUNK prefill tokens a step, the two prefills' last chunks aside: that many chunks at least
    # (how the steps split the tokens between the two turns depends on timing).
    assert engine.batcher.stats.prefill_chunks >= -(-fed // CHUNK) - 2 and not mem.chunking


async def _stopped_turn(engine, session, how: str, monkeypatch) -> None:
    """Send a long message and stop its turn after its first chunk, as ``how`` says."""
    chunks = engine.batcher.stats.prefill_chunks
    refusals = engine.memory_account.refusals
    # After the turn's first chunk (not the last step of the turn before: its accounting may run late).
    fired = await turn_helpers.stopped_turn(engine, session, message(engine, 5, 230), PARAMS, how, monkeypatch,
                                            lambda: engine.batcher.stats.prefill_chunks > chunks)
    assert how != "refusal" or engine.memory_account.refusals == refusals + 1
    assert fired and engine.batcher.stats.prefills_stopped == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rocketkv", "tiered"])
@pytest.mark.parametrize("how", ["cancel", "disconnect", "refusal"])
async def test_a_turn_stopped_between_chunks_leaves_the_session_as_before(make_engine, monkeypatch, mode, how):
    engine = make_engine(prefill_chunk=CHUNK, device_budget_bytes=8 * 1024**3)
    # Budget 256: the first turn leaves nothing cold, so that tiered's next prefill can be chunked.
    reference, stopped = (engine.create_session(mode=mode, budget=256) for _ in range(2))
    first = message(engine, 6, 40)
    for session in (reference, stopped):
        await run_turn(engine, session.id, first)

    await _stopped_turn(engine, stopped, how, monkeypatch)
    assert not stopped.busy and stopped.id not in engine.memory_account.reserved
    assert stopped.id not in engine.memory_account.chunking
    assert stopped.messages == reference.messages
    assert stopped.token_ids == reference.token_ids
    assert cache_state(stopped) == cache_state(reference)
    for a, b in zip(stopped.cache.layers, reference.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
    assert engine.memory_account.held[stopped.id] == engine.memory_account.held[reference.id]

    # The next turn goes exactly as if the stopped one had never been sent.
    nxt = message(engine, 7, 120)
    done_ref = await run_turn(engine, reference.id, nxt)
    done_stopped = await run_turn(engine, stopped.id, nxt)
    assert reply_ids(stopped, done_stopped) == reply_ids(reference, done_ref)
    assert done_stopped.usage == done_ref.usage
    assert stopped.messages == reference.messages and cache_state(stopped) == cache_state(reference)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "snapkv"])
def test_a_chunked_prefill_allocates_its_layers_once(make_engine, mode):
    # The first chunk makes room for the whole turn: a later chunk's step, which carries the other
    # sessions' decode tokens, never copies the history to grow the buffers.
    from app.engine.model_runner import Segment
    from rocketkv_mt.config import RocketKVConfig

    engine = make_engine()
    ids = engine.tokenizer.encode(message(engine, 5, 400))
    cache = engine.new_cache(mode, RocketKVConfig(token_budget=64), "grow-once")
    try:
        where = None
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            rest = len(ids) - start - len(chunk)
            engine.runner.step([Segment(cache, chunk, prefill=True, max_new=8, rest=rest)])
            if rest == 0:
                break
            now = [layer.buffers[0].data_ptr() for layer in cache.layers]
            assert where is None or now == where, start
            where = now
        assert len(ids) > 5 * CHUNK and cache.history_len == len(ids)
    finally:
        cache.release()
