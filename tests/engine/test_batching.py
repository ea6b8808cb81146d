"""Continuous batching: sessions generating at the same time share model steps, and each still gets
exactly what it would have got alone (greedy and seeded sampling), its own cancellation, and its
own failures; the batched decode kernel gives the per-session torch path's tokens."""
import asyncio
import concurrent.futures

import pytest
import torch

from app.engine.events import TextDelta, TurnDone
from app.engine.sampling import SamplingParams
from bench.common import fit_words
from bench.haystack import filler_text

pytestmark = pytest.mark.slow

# (mode, budget, words of filler in the first message): different modes, kept lengths and splits;
# budgets below the history so that the compressed modes decode with HSA over a selection.
SESSIONS = [("tiered", 64, 420), ("rocketkv-mt", 64, 300), ("full", 64, 160), ("rocketkv", 48, 500),
            ("snapkv", 64, 260)]
SECOND = "Now say it again in other words."


def first_message(engine, i: int, words: int) -> str:
    return fit_words(engine.tokenizer, filler_text(words, seed=i), words) + "\n\nWhat is this text about?"


def reply_ids(session, done: TurnDone) -> list[int]:
    start = done.usage.prompt_tokens
    return session.token_ids[start : start + done.usage.generated_tokens]


async def run_turn(engine, sid, text, params, cancel_after=None):
    deltas = 0
    async for event in await engine.chat(sid, text, params):
        if isinstance(event, TextDelta):
            deltas += 1
            if cancel_after is not None and deltas == cancel_after:
                engine.cancel(sid)
        else:
            return event


async def converse(engine, specs, params, concurrent: bool, cancel=None):
    """Two turns per session; returns {i: [(ids, done), ...]}."""
    sessions = [engine.create_session(mode=m, budget=b) for m, b, _ in specs]
    firsts = [first_message(engine, i, w) for i, (_, _, w) in enumerate(specs)]
    out = {i: [] for i in range(len(specs))}

    async def one(i, text):
        done = await run_turn(engine, sessions[i].id, text, params[i], cancel_after=(cancel or {}).get(i))
        out[i].append((reply_ids(sessions[i], done), done))

    for turn in range(2):
        texts = firsts if turn == 0 else [SECOND] * len(specs)
        if concurrent:
            # Staggered starts: prefills of later sessions join the decode steps of earlier ones.
            async def staggered(i, text):
                await asyncio.sleep(0.05 * i)
                await one(i, text)

            await asyncio.gather(*(staggered(i, t) for i, t in enumerate(texts)))
        else:
            for i, text in enumerate(texts):
                await one(i, text)
    return out, sessions


async def test_batched_decode_equals_each_session_alone(make_engine):
    params = [SamplingParams(max_tokens=14)] * len(SESSIONS)
    params[1] = SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=7)  # its own generator
    # Alone, each step runs per session on the torch path; batched, every layer's decode of all the
    # sessions is one call of the native kernel (rocketkv_mt/cache/batch.py): the tokens must not differ.
    alone_engine = make_engine(kernels="torch")
    alone, _ = await converse(alone_engine, SESSIONS, params, concurrent=False)
    assert alone_engine.batcher.stats.max_batch == 1
    engine = make_engine()
    batched, sessions = await converse(engine, SESSIONS, params, concurrent=True)
    stats = engine.batcher.stats
    # The steps really were shared: many more decode tokens than decode-carrying steps.
    assert stats.max_batch >= 4
    assert stats.decode_tokens >= 1.8 * stats.decode_steps
    assert stats.mixed_steps >= 2  # later sessions' prefills joined the earlier ones' decode steps
    for i, (mode, _, _) in enumerate(SESSIONS):
        for turn in range(2):
            ids_a, done_a = alone[i][turn]
            ids_b, done_b = batched[i][turn]
            assert ids_b == ids_a, (mode, turn)
            assert done_b.text == done_a.text
            assert done_b.usage == done_a.usage
        assert len(ids_a) > 0
    assert sessions[3].cache.kept_tokens() > sessions[3].cache.split.token_budget  # HSA, not exact attention


async def test_cancel_and_failure_stay_in_their_own_session(make_engine):
    specs = SESSIONS[:4]
    params = [SamplingParams(max_tokens=12)] * len(specs)
    alone, _ = await converse(make_engine(), specs, params, concurrent=False)

    engine = make_engine()
    sessions = [engine.create_session(mode=m, budget=b) for m, b, _ in specs]
    texts = [first_message(engine, i, w) for i, (_, _, w) in enumerate(specs)]
    # Session 2's cache fails at its 4th decode step, inside a batched step with the others.
    victim = 2
    calls = {"n": 0}

    async def start(i):
        await asyncio.sleep(0.05 * i)
        return await run_turn(engine, sessions[i].id, texts[i], params[i], cancel_after=3 if i == 1 else None)

    cache = sessions[victim].cache

    def failing(method):
        def call(layer, *args):
            if layer == 5:
                calls["n"] += 1
                if calls["n"] == 4:
                    raise RuntimeError("injected cache failure")
            return method(layer, *args)

        return call

    # A batched decode step asks each cache for its part (decode_target); a step alone calls decode_attention.
    cache.decode_target = failing(cache.decode_target)
    cache.decode_attention = failing(cache.decode_attention)
    tasks = [asyncio.ensure_future(start(i)) for i in range(len(specs))]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[victim], RuntimeError)
    assert engine.batcher.stats.failed_segments == 1 and engine.batcher.stats.failed_steps == 0
    assert results[1].finish_reason == "cancelled"
    assert 3 <= results[1].usage.generated_tokens < params[1].max_tokens
    cancelled_ids = reply_ids(sessions[1], results[1])
    assert cancelled_ids == alone[1][0][0][: len(cancelled_ids)]
    for i in (0, 3):
        assert reply_ids(sessions[i], results[i]) == alone[i][0][0], specs[i][0]
        assert engine.batcher.stats.max_batch >= 3
    # The failed session rebuilds its cache from the token ids and goes on.
    assert sessions[victim].cache is None and sessions[victim].messages[-1].get("error")
    done = await run_turn(engine, sessions[victim].id, SECOND, params[victim])
    assert done.usage.generated_tokens > 0 and done.usage.prefilled_tokens == done.usage.prompt_tokens


async def test_step_segments_match_single_forward(make_engine):
    """The runner's packed step: a prefill segment next to decode segments gives the same logits
    as separate forwards (up to float rounding) and the same greedy token."""
    from app.engine.model_runner import Segment
    from rocketkv_mt.config import RocketKVConfig

    engine = make_engine()
    runner = engine.runner
    prompts = [engine.chat_format.encode(first_message(engine, i, 120 + 60 * i)) for i in range(3)]
    rocket = RocketKVConfig(token_budget=48)
    alone = []
    for i, ids in enumerate(prompts):
        cache = engine.new_cache("tiered" if i % 2 == 0 else "rocketkv", rocket, f"t{i}")
        first = runner.forward(ids, cache, prefill=True, max_new=4)
        alone.append((first, runner.forward([int(first.argmax())], cache, prefill=False)))
    caches = [engine.new_cache("tiered" if i % 2 == 0 else "rocketkv", rocket, f"b{i}") for i in range(3)]
    logits, errors = runner.step([Segment(caches[0], prompts[0], prefill=True, max_new=4),
                                  Segment(caches[1], prompts[1], prefill=True, max_new=4)])
    assert not errors and logits.shape[0] == 2
    tok0, tok1 = int(logits[0].argmax()), int(logits[1].argmax())
    logits2, errors = runner.step([Segment(caches[0], [tok0]), Segment(caches[2], prompts[2], prefill=True, max_new=4),
                                   Segment(caches[1], [tok1])])
    assert not errors
    torch.testing.assert_close(logits[0], alone[0][0], atol=2e-3, rtol=0)
    torch.testing.assert_close(logits[1], alone[1][0], atol=2e-3, rtol=0)
    torch.testing.assert_close(logits2[0], alone[0][1], atol=2e-3, rtol=0)
    torch.testing.assert_close(logits2[1], alone[2][0], atol=2e-3, rtol=0)
    torch.testing.assert_close(logits2[2], alone[1][1], atol=2e-3, rtol=0)
    assert [c.history_len for c in caches] == [len(prompts[0]) + 1, len(prompts[1]) + 1, len(prompts[2])]


async def test_the_model_thread_and_page_reader_flush_subnormal_floats_as_set(make_engine):
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode")

    def flushes_here() -> bool:
        return float(torch.tensor([1e-39]) * 1.0) == 0.0

    for flush in (True, False):
        engine = make_engine(flush_denormal=flush)
        assert await engine.batcher.run(flushes_here) is flush
        job = engine.transfers.start(flushes_here)
        # Let the worker claim it: a wait before then would run it in this (non-flushing) thread.
        concurrent.futures.wait([job], timeout=30)
        assert engine.transfers.wait(job) is flush
    assert not flushes_here()
