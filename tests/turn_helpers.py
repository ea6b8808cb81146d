"""What the engine tests of long prompts share: a filler message of a given size, a whole turn run
through ``Engine.chat``, and the ids of the reply it generated."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from app.engine.errors import DeviceMemoryExhausted
from app.engine.events import TextDelta, TurnDone
from app.engine.sampling import SamplingParams
from bench.common import fit_words
from bench.haystack import filler_text


def message(engine, seed: int, words: int) -> str:
    """About ``words`` tokens of filler (cut at a sentence end), then a question."""
    return fit_words(engine.tokenizer, filler_text(words, seed=seed), words) + "\n\nWhat is this text about?"


async def run_turn(engine, sid: str, text: str, params: SamplingParams) -> TurnDone:
    async for event in await engine.chat(sid, text, params):
        if isinstance(event, TurnDone):
            return event


async def stream(engine, sid: str, text: str, params: SamplingParams, started: asyncio.Event, after: int) -> TurnDone:
    """A turn run to its end while it streams; ``started`` is set once ``after`` deltas have come."""
    deltas = 0
    async for event in await engine.chat(sid, text, params):
        if isinstance(event, TextDelta):
            deltas += 1
            if deltas == after:
                started.set()
        else:
            return event


def reply_ids(session, done: TurnDone) -> list[int]:
    start = done.usage.prompt_tokens
    return session.token_ids[start : start + done.usage.generated_tokens]


async def stopped_turn(engine, session, text: str, params: SamplingParams, how: str, monkeypatch,
                       ready: Callable[[], bool]) -> bool:
    """Send ``text`` and stop its turn, between two steps of its prefill once ``ready()`` holds, as ``how``
    says: ``cancel`` (the turn ends cancelled, nothing generated), ``disconnect`` (its caller goes) or
    ``refusal`` (a reservation the prefill outgrows at once: refused). Returns whether the stop came from
    here (a refusal comes by itself)."""
    loop = asyncio.get_running_loop()
    fired = []
    after_step = engine.batcher.on_step
    task = asyncio.ensure_future(run_turn(engine, session.id, text, params))
    if how == "refusal":
        monkeypatch.setattr(engine.memory_account, "turn_bound", lambda *args, **kwargs: 1)

    def on_step(keys):
        after_step(keys)
        if session.id in keys and ready() and not fired:
            fired.append(True)
            if how == "cancel":
                engine.cancel(session.id)
            elif how == "disconnect":
                loop.call_soon_threadsafe(task.cancel)

    engine.batcher.on_step = on_step
    try:
        if how == "cancel":
            done = await task
            assert done.finish_reason == "cancelled" and done.usage.generated_tokens == 0 and done.text == ""
        elif how == "disconnect":
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(DeviceMemoryExhausted):
                await task
    finally:
        engine.batcher.on_step = after_step
        monkeypatch.undo()
    return bool(fired)
