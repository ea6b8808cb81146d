"""Turns run at most once (pure logic, no model): attempts of one turn wait for each other, and a
finished turn is answered again from what the session kept."""
from __future__ import annotations

import asyncio

from app.contract.events import Delta, Done, MemoryStats, TurnStarted
from app.engine.session import Session, TurnStats
from app.session_turns import TurnKeys, keep, replay
from rocketkv_mt.config import RocketKVConfig


async def test_attempts_of_one_turn_run_one_at_a_time_other_turns_do_not_wait():
    keys = TurnKeys()
    order: list[str] = []
    release = await keys.claim("s_a", "k1")

    async def second() -> None:
        again = await keys.claim("s_a", "k1")
        order.append("second attempt")
        again()

    waiting = asyncio.create_task(second())
    (await keys.claim("s_a", "k2"))()  # another turn's key, or another session: no wait
    (await keys.claim("s_b", "k1"))()
    await asyncio.sleep(0.05)
    assert order == [] and not waiting.done()
    order.append("first attempt ends")
    release()
    release()  # a second release changes nothing
    await asyncio.wait_for(waiting, 1)
    assert order == ["first attempt ends", "second attempt"]
    (await asyncio.wait_for(keys.claim("s_a", "k1"), 1))()  # free again


def finished_session(finish: str) -> Session:
    session = Session(id="s_a", mode="tiered", rocket=RocketKVConfig(), cache=None)
    session.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    session.turns = [TurnStats(prompt_tokens=9, prefilled_tokens=9, generated_tokens=3, finish_reason=finish,
                               ttft_ms=5.0, latency_ms=20.0)]
    return session


def test_a_finished_turn_is_answered_from_what_the_session_kept():
    session = finished_session("stop")
    keep(session, "k1", "replica-a", turns_before=0)
    memory = MemoryStats(device_bytes=123)
    events = replay(session, "k1", "replica-b", lambda _: memory)
    assert events[:2] == [TurnStarted("s_a", "replica-b"), Delta("Hello there")]
    done = events[2]
    assert isinstance(done, Done) and done.replica == "replica-a" and done.memory == memory
    assert (done.finish_reason, done.usage.generated_tokens, done.latency_ms) == ("stop", 3, 20.0)
    assert replay(session, "k2", "replica-b", lambda _: memory) is None  # another key: that turn has not run
    assert replay(session, None, "replica-b", lambda _: memory) is None
    failed = finished_session("error")
    keep(failed, "k1", "replica-a", turns_before=0)
    assert failed.last_turn is None  # a failed turn runs again when sent again
    # A turn undone (stopped in its prefill, refused half-way) adds no turn: the last one is another
    # turn's, which must not answer this key (sent again, this turn runs).
    keep(session, "k3", "replica-a", turns_before=1)
    assert session.last_turn["key"] == "k1" and replay(session, "k3", "replica-b", lambda _: memory) is None
