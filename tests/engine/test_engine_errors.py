"""Bad input raises the engine's own errors and leaves the session exactly as it was."""
import copy

import pytest

from app.engine.errors import (
    ContextLengthExceeded,
    EmptyMessage,
    EngineError,
    InvalidSamplingParams,
    MessageTooLarge,
    SessionBusy,
    SessionNotFound,
    UnknownMode,
)
from app.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow


def snapshot(session):
    return (
        copy.deepcopy(session.messages),
        list(session.token_ids),
        session.fed_tokens,
        session.cache.kept_tokens(),
        len(session.turns),
        session.busy,
    )


@pytest.fixture
async def chatted(make_engine):
    engine = make_engine(max_context=600)
    session = engine.create_session()
    await engine.complete(session.id, "Hi there.", SamplingParams(max_tokens=6))
    return engine, session


@pytest.mark.parametrize("content", ["", "   \n\t "])
async def test_empty_message(chatted, content):
    engine, session = chatted
    before = snapshot(session)
    with pytest.raises(EmptyMessage):
        await engine.chat(session.id, content)
    assert snapshot(session) == before


async def test_message_longer_than_context(chatted):
    engine, session = chatted
    before = snapshot(session)
    with pytest.raises(ContextLengthExceeded) as err:
        await engine.chat(session.id, "word " * 2000)
    assert err.value.code == "context_length_exceeded"
    assert snapshot(session) == before
    done = await engine.complete(session.id, "Still there?", SamplingParams(max_tokens=4))
    assert done.usage.generated_tokens >= 1


async def test_message_over_byte_limit(make_engine):
    engine = make_engine(max_message_bytes=100)
    session = engine.create_session()
    before = snapshot(session)
    with pytest.raises(MessageTooLarge):
        await engine.chat(session.id, "é" * 51)
    assert snapshot(session) == before


@pytest.mark.parametrize(
    "values",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"bogus": 1},
    ],
)
async def test_invalid_sampling_values(chatted, values):
    engine, session = chatted
    before = snapshot(session)
    with pytest.raises(InvalidSamplingParams):
        params = SamplingParams.parse(**values)
        await engine.chat(session.id, "hello", params)
    assert snapshot(session) == before


async def test_max_tokens_over_server_limit(make_engine):
    engine = make_engine(max_tokens_limit=10)
    session = engine.create_session()
    with pytest.raises(MessageTooLarge):
        await engine.chat(session.id, "hello", SamplingParams(max_tokens=11))
    assert session.token_ids == []


@pytest.mark.parametrize("bad_id", ["nope", "", None, 42])
async def test_unknown_session(make_engine, bad_id):
    engine = make_engine()
    with pytest.raises(SessionNotFound):
        await engine.chat(bad_id, "hello")
    with pytest.raises(SessionNotFound):
        await engine.delete_session(bad_id)


async def test_unknown_mode(make_engine):
    engine = make_engine()
    with pytest.raises(UnknownMode):
        engine.create_session(mode="lossless-magic")
    assert engine.sessions == {}


async def test_second_message_while_generating_is_busy(chatted):
    engine, session = chatted
    stream = await engine.chat(session.id, "Tell me a story.", SamplingParams(max_tokens=20))
    first = await stream.__anext__()
    assert first is not None
    with pytest.raises(SessionBusy):
        await engine.chat(session.id, "interrupt!")
    rest = [e async for e in stream]
    assert rest[-1].finish_reason in ("stop", "length")
    assert [m["role"] for m in session.messages].count("user") == 2


def test_errors_carry_codes():
    codes = {cls.code for cls in (EmptyMessage, ContextLengthExceeded, InvalidSamplingParams, SessionNotFound,
                                  SessionBusy, MessageTooLarge, UnknownMode)}
    assert len(codes) == 7
    assert all(issubclass(c, EngineError) for c in (EmptyMessage, SessionBusy))
