"""Rebuilding a lost cache exactly: the same tokens, fed through the same steps, in the same order.

A session's cache is a deterministic function of what it was fed since it was created: each turn's
prefill (its tokens, and the ``max_new`` that its budget split used), the decode steps of the reply
(each feeds the token sampled before it), and the turn's end (where a tiered cache settles its
re-selection). When part of a cache is lost — cold pages spilled to a Redis that went away — feeding
the same tokens again through the same steps rebuilds the very same cache, so the next reply is the
one the lost cache would have given. Feeding the history in one prefill instead would give another
cache (other selections, other re-admissions), and so other replies.

The cost is that of the conversation so far: one prefill per turn and one decode step per token
generated. So a turn replays (``CacheRebuild._rebuild``) only where the session's feed log accounts
for exactly what the lost cache had been fed (``Session.lost_fed``) and that is at most
``Settings.replay_max_tokens``; otherwise it prefills the whole history into the empty cache. The log
travels in the session record (``app.session_restore``), so another process replays it too.

A replay is a turn's work like its prefill: every cache operation on the model thread (the steps
through the batcher, each replayed turn's end as a job); device memory held for the turns it feeds
(``DeviceMemory.replay_sizes``), not for one prefill into an empty cache; a ``TurnStatus`` before the
first replayed turn and after each. A cancel, a refusal between two chunks, or a caller that leaves
stops it: the half-built cache is dropped and the turn undone, the session keeping its history, its
log and ``lost_fed``, so that its next turn rebuilds again.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from app.engine.batcher import Batcher
from app.engine.errors import ChatError, StoreUnavailable, TurnCancelled
from app.engine.events import TurnStatus
from app.engine.memory import DeviceMemory
from app.engine.sampling import TokenSampler, plain_sampler
from app.engine.session import Feed, Session
from app.engine.steps import PrefillGate
from app.settings import Settings
from rocketkv_mt.cache import SessionCache
from tiers.host.tier import ChunkUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

# The steps feed tokens already chosen: what the batcher draws after each is discarded, so the
# cheapest draw (greedy, no generator whose state would move) does.
TEACHER_FORCED: TokenSampler = plain_sampler()
# What stops a replay and undoes its turn (the session as it was before): a cancel, a refusal, a caller
# gone. Any other failure fails the turn as a failed prefill does.
_STOPS = (TurnCancelled, ChatError, GeneratorExit, asyncio.CancelledError)


def _redis_gone() -> StoreUnavailable:
    return StoreUnavailable("part of this session's history lies in Redis, which cannot be reached now, so its "
                            "cache cannot be rebuilt; the session is unchanged: retry later")


def replayable(feeds: list[Feed], fed: int) -> bool:
    """Whether ``feeds`` account for exactly the ``fed`` tokens the lost cache had been fed."""
    return bool(feeds) and sum(f.prefill + f.decodes for f in feeds) == fed


def plan(session: Session, max_tokens: int) -> list[Feed] | None:
    """The feeds that rebuild the session's lost cache: copies of its log where that accounts for the
    ``lost_fed`` tokens, a part of its history, of at most ``max_tokens``; None otherwise (nothing lost,
    or the history is to be prefilled in one go)."""
    lost = session.lost_fed
    if not 0 < lost <= min(max_tokens, len(session.token_ids)) or not replayable(session.feeds, lost):
        return None
    return [dataclasses.replace(f) for f in session.feeds]  # the turn after the replay extends its log


async def replay(
    batcher: Batcher, session: Session, cache: SessionCache, feeds: list[Feed], gate: PrefillGate
) -> AsyncIterator[TurnStatus]:
    """Feed an empty ``cache`` the first tokens of the session's history as ``feeds`` say they were fed,
    yielding how far it is before the first feed and after each. A cancel of the turn raises
    ``TurnCancelled`` before the next step; the batcher checks ``gate`` between chunks of a prefill."""
    ids, total = session.token_ids, sum(f.prefill + f.decodes for f in feeds)
    pos = 0
    for i, feed in enumerate(feeds):
        yield TurnStatus("replay", i, len(feeds), pos, total)
        _stop_if_cancelled(session)
        await batcher.prefill(session.id, cache, ids[pos : pos + feed.prefill], feed.max_new, TEACHER_FORCED, gate)
        pos += feed.prefill
        with batcher.decoding():  # the model thread waits for each step, as for a turn's reply
            for token in ids[pos : pos + feed.decodes]:
                _stop_if_cancelled(session)
                await batcher.decode(session.id, cache, token, TEACHER_FORCED)
        pos += feed.decodes
        # The turn's end settles what its prefill deferred, moving bytes between the tiers: only the
        # model thread touches them while steps run.
        await batcher.run(cache.end_turn, after=cache)
    yield TurnStatus("replay", len(feeds), len(feeds), pos, total)


def _stop_if_cancelled(session: Session) -> None:
    if session.cancel_requested:
        raise TurnCancelled("cancelled while the session's cache was rebuilt")


class CacheRebuild:
    """A turn's rebuild of its session's lost cache. A mixin of ``Engine`` (``app.engine.engine``), on
    the engine's state named below."""

    settings: Settings
    batcher: Batcher
    memory_account: DeviceMemory
    rebuilds: Counter  # caches restored from their record's KV, or rebuilt (by replay, or one prefill)
    _step: Callable[[Callable[[], T]], Awaitable[T]]
    _admit: Callable[[Session, int, int, list[Feed] | None], None]
    _rebuild_cache: Callable[[Session], SessionCache]
    _release_quietly: Callable[[Session, SessionCache], None]

    def _replay_plan(self, session: Session) -> list[Feed] | None:
        return plan(session, self.settings.replay_max_tokens)

    async def _rebuild(self, session: Session, max_new: int, gate: PrefillGate) -> AsyncIterator[TurnStatus]:
        """Give the session of a turn under way (its new tokens already in ``token_ids``) an empty cache
        and replay its log into it (``plan``), reporting progress; without a plan the turn's own prefill
        feeds the whole history. Either way the turn's device memory and host room are held again, for
        what it now feeds (refused: the turn is undone, ``gate.undone``)."""
        feeds = self._replay_plan(session)
        log.warning("session %s: rebuilding its lost cache (%s)", session.id,
                    f"replaying {len(feeds)} turns" if feeds else "one prefill of the history")
        self.rebuilds["replayed" if feeds else "reprefilled"] += 1
        cache = await self._step(lambda: self._rebuild_cache(session))
        try:
            self._admit(session, 0, max_new, feeds)
        except ChatError:
            gate.undone = True  # refused before anything was fed: the session is as before the turn
            raise
        if feeds is None:
            session.feeds.clear()
            session.lost_fed = 0
            return
        try:
            async with contextlib.aclosing(replay(self.batcher, session, cache, feeds, gate)) as statuses:
                async for status in statuses:
                    yield status
        except BaseException as exc:
            if isinstance(exc, (*_STOPS, ChunkUnavailable)):
                gate.undone = True
            await self._drop_rebuilt(session, wait=isinstance(exc, Exception))
            if isinstance(exc, ChunkUnavailable):
                # Pages the replay demoted spilled to Redis, unreachable now: not this turn's fault, and
                # nothing was sent; the session is as before it (its cache still to rebuild).
                raise _redis_gone() from exc
            raise
        session.feeds, session.lost_fed = feeds, 0

    async def _rebuilt_unreadable(self, session: Session, fed: int, gate: PrefillGate) -> StoreUnavailable:
        """The turn's own prefill, after its cache was rebuilt (``fed`` tokens), found pages the rebuild
        spilled to Redis unreadable: the rebuilt cache goes (the next turn rebuilds it again) and the turn is
        undone, refused as a store outage; returns the error to raise."""
        session.lost_fed = fed
        await self._drop_rebuilt(session, wait=True)
        gate.undone = True
        return _redis_gone()

    async def _drop_rebuilt(self, session: Session, wait: bool) -> None:
        """Drop a half-rebuilt cache: the session has none (it holds no device memory), and its next turn
        rebuilds again. Its tier pages are freed on the model thread, which alone touches the tiers
        while steps run; a turn whose caller left (closed, or finalised outside the loop) cannot wait
        for that."""
        dropped = self.memory_account.take_cache(session)
        if dropped is None:
            return
        if wait:
            await self._step(lambda: self._release_quietly(session, dropped))
        else:
            self.batcher.submit(lambda: self._release_quietly(session, dropped))
