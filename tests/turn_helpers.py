"""What the engine tests of long prompts share: a filler message of a given size, a whole turn run
through ``Engine.chat``, and the ids of the reply it generated."""
from __future__ import annotations

import asyncio

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
