"""Stateful turns: the session cache gives the same greedy replies as re-running from scratch."""
import pytest
import torch

from app.engine.sampling import SamplingParams
from app.engine.events import TextDelta, TurnDone

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name three colours of the rainbow.",
    "Which of those is closest to blue?",
    "Write one short sentence about the sea.",
]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Reference: transformers' own generate with its SDPA attention and DynamicCache, from scratch."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
            )
    finally:
        model.set_attn_implementation("rocketkv")
    return out[0, len(ids):].tolist()


async def test_three_turns_match_stateless_rerun(make_engine, loaded):
    engine = make_engine(mode="full")
    session = engine.create_session()
    params = SamplingParams(max_tokens=24)
    for turn, question in enumerate(QUESTIONS):
        fed_before = session.fed_tokens
        deltas, done = [], None
        async for event in await engine.chat(session.id, question, params):
            if isinstance(event, TextDelta):
                deltas.append(event.text)
            else:
                done = event
        assert isinstance(done, TurnDone)
        assert "".join(deltas) == done.text
        n_gen = done.usage.generated_tokens
        start = done.usage.prompt_tokens
        prompt_ids = session.token_ids[:start]
        generated = session.token_ids[start:start + n_gen]
        assert generated == hf_greedy(loaded.model, prompt_ids, n_gen)[: len(generated)]
        # Only what this turn added (plus the previous reply's last, unfed token) is prefilled.
        assert done.usage.prefilled_tokens == start - fed_before
        if turn == 0:
            assert done.usage.prefilled_tokens == start
        else:
            assert done.usage.prefilled_tokens < 40 < start
            new_block = engine.chat_format.encode(question)
            assert done.usage.prefilled_tokens >= len(new_block)


async def test_stream_is_async_iterator_of_deltas_then_done(make_engine):
    engine = make_engine()
    session = engine.create_session()
    events = [e async for e in await engine.chat(session.id, "Say hello.", SamplingParams(max_tokens=8))]
    assert isinstance(events[-1], TurnDone)
    assert all(isinstance(e, TextDelta) for e in events[:-1])
    assert events[-1].usage.generated_tokens <= 8
    assert session.messages[-1]["role"] == "assistant"
    assert session.messages[-1]["content"] == events[-1].text


async def test_max_tokens_gives_length_and_next_turn_still_works(make_engine):
    engine = make_engine()
    session = engine.create_session()
    done = await engine.complete(session.id, "Count from one to fifty in words.", SamplingParams(max_tokens=5))
    assert done.finish_reason == "length"
    assert done.usage.generated_tokens == 5
    done2 = await engine.complete(session.id, "Thanks. What is two plus two?", SamplingParams(max_tokens=16))
    assert done2.usage.prompt_tokens > done.usage.prompt_tokens
    assert len(session.messages) == 4


async def test_stop_string_truncates_reply(make_engine):
    engine = make_engine()
    session = engine.create_session()
    free = await engine.complete(session.id, "Count from one to ten in words.", SamplingParams(max_tokens=30))
    words = free.text.split()
    assert len(words) > 3
    stop = words[2]
    other = engine.create_session()
    done = await engine.complete(
        other.id, "Count from one to ten in words.", SamplingParams(max_tokens=30, stop=(stop,))
    )
    assert done.finish_reason == "stop"
    assert stop not in done.text
    assert free.text.startswith(done.text)


async def test_sampling_with_seed_is_reproducible(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    a = await engine.complete(engine.create_session().id, "Tell me a word.", params)
    b = await engine.complete(engine.create_session().id, "Tell me a word.", params)
    assert a.text == b.text


async def test_cancel_mid_stream_keeps_partial_reply_and_session_usable(make_engine):
    engine = make_engine()
    session = engine.create_session()
    stream = await engine.chat(session.id, "Write a long story about a dragon.", SamplingParams(max_tokens=64))
    got = []
    async for event in stream:
        got.append(event)
        if len(got) == 3:
            break
    await stream.aclose()
    assert not session.busy
    reply = session.messages[-1]
    assert reply["role"] == "assistant" and reply.get("cancelled") is True
    assert reply["content"].startswith("".join(e.text for e in got))
    assert session.turns[-1].finish_reason == "cancelled"
    done = await engine.complete(session.id, "Now say yes.", SamplingParams(max_tokens=8))
    assert done.usage.prefilled_tokens < 30


async def test_engine_cancel_flag_stops_generation(make_engine):
    engine = make_engine()
    session = engine.create_session()
    events = []
    async for event in await engine.chat(session.id, "Write a long poem about stars.", SamplingParams(max_tokens=64)):
        events.append(event)
        if len(events) == 2:
            assert engine.cancel(session.id)
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].usage.generated_tokens < 64
