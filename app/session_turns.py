"""A session's turns as the service runs them: checked, started, streamed, saved before their
``done``, and run at most once.

Each turn may carry an idempotency key, kept by the session with its last finished turn
(``Session.last_turn``, saved in its record).

A caller that lost a turn's answer (its replica died mid-stream, its connection dropped) sends the
turn again under the same key. If that turn finished, here or on a replica whose record this one
restored, the answer is rebuilt from what the session kept: the whole reply as one delta, then its
``done``. If it is still running on this replica, the retry first waits for it to end. Only a turn
that never finished runs again.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from app.contract.errors import (
    ChatError,
    HistoryMismatch,
    InvalidRequest,
    SessionDiverged,
    SessionMoved,
    SessionNotFound,
    StoreUnavailable,
)
from app.contract.events import (
    Delta,
    Done,
    MapSummary,
    MemoryStats,
    Saved,
    Status,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    Usage,
)
from app.engine.engine import Engine
from app.engine.events import TextDelta, TurnDone, TurnStatus
from app.engine.sampling import SamplingParams
from app.engine.session import Session
from app.session_map import map_summary
from app.session_restore import checked_sampling, is_unicode
from app.session_fence import DIVERGED
from app.session_store import DELETED, MOVED

log = logging.getLogger(__name__)
KEY_MAX = 128  # longer keys are refused: they are stored with every record


def _nothing() -> None:
    return None


def _status(status: TurnStatus) -> Status:
    return Status(status.stage, status.done, status.total, status.tokens, status.total_tokens)


class TurnKeys:
    """The attempts of a turn (same session, same key) under way in this replica: one at a time."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str], asyncio.Event] = {}

    async def claim(self, sid: str, key: str | None) -> Callable[[], None]:
        """Wait until no attempt of this turn runs here, then mark this one as running; returns the
        release, to call once the attempt's outcome is kept (calling it again does nothing)."""
        if key is None:
            return _nothing
        slot = (sid, key)
        while (running := self._running.get(slot)) is not None:
            await running.wait()
        ended = self._running[slot] = asyncio.Event()

        def release() -> None:
            if self._running.get(slot) is ended:
                del self._running[slot]
            ended.set()

        return release


def keep(session: Session, key: str | None, replica: str, turns_before: int) -> None:
    """Remember the turn that just finished (the session's last stats and reply) under ``key``; a
    failed turn is not kept (sent again, it runs), nor one undone (``turns_before``: the session's turns
    when it began; an undone turn adds none, and the last one is another turn's)."""
    if key is None or len(session.turns) <= turns_before or session.turns[-1].finish_reason == "error":
        return
    turn, reply = session.turns[-1], session.messages[-1]
    session.last_turn = {
        "key": key,
        "text": reply["content"],
        "finish_reason": turn.finish_reason,
        "usage": {"prompt_tokens": turn.prompt_tokens, "prefilled_tokens": turn.prefilled_tokens,
                  "generated_tokens": turn.generated_tokens},
        "ttft_ms": turn.ttft_ms,
        "latency_ms": turn.latency_ms,
        "replica": replica,
    }


def replay(
    session: Session, key: str | None, replica: str, memory: Callable[[Session], MemoryStats],
    memory_map: Callable[[Session], MapSummary] | None = None, storage: Saved | None = None,
) -> list[TurnEvent] | None:
    """The events of the session's last turn if it was sent under ``key`` (its ``done`` with the
    session's memory, its map's summary and what is saved of it, now); None when it was not (that turn
    has not run: the caller runs it)."""
    last: dict[str, Any] | None = session.last_turn
    if key is None or not last or last.get("key") != key:
        return None
    events: list[TurnEvent] = [TurnStarted(session_id=session.id, replica=replica)]
    if last["text"]:
        events.append(Delta(last["text"]))
    events.append(Done(
        finish_reason=last["finish_reason"],
        usage=Usage(**last["usage"]),
        memory=memory(session),
        replica=last["replica"],
        session_id=session.id,
        ttft_ms=last["ttft_ms"],
        latency_ms=last["latency_ms"],
        memory_map=memory_map(session) if memory_map is not None else None,
        storage=storage,
    ))
    return events


class Turns:
    """The chat verb of ``ChatService``, given how it finds a session (access checks and restore
    included), what it checks before a turn runs (quotas, whether Redis can take it), how it saves one,
    where it runs background work, and, where turns that cannot be saved are refused, how it takes back a
    turn whose save failed (the local copy goes: the session is its stored state again)."""

    def __init__(
        self,
        engine: Engine,
        replica: str,
        session_of: Callable[[str, str | None, str | None], Awaitable[tuple[Session, bool]]],
        persist: Callable[..., Awaitable[tuple[str | None, Saved | None]]],  # (session, tells=False)
        spawn: Callable[[Awaitable[None]], None],
        admit: Callable[[Session], Awaitable[None]] | None = None,
        take_back: Callable[[str], None] | None = None,
        stored_state: Callable[[str], Saved | None] = lambda sid: None,
    ):
        self.engine = engine
        self.replica = replica
        self.session_of = session_of
        self.persist = persist
        self.spawn = spawn
        self.admit = admit
        self.take_back = take_back
        self.stored_state = stored_state  # what is saved of a session now (a turn answered again says it)
        self.keys = TurnKeys()

    async def run(
        self,
        sid: str,
        token: str | None,
        content: str,
        sampling: dict[str, Any] | None,
        history: list[list[str]] | None,
        owner: str | None,
        turn_key: str | None,
    ) -> AsyncIterator[TurnEvent]:
        if turn_key is not None and (not isinstance(turn_key, str) or not 0 < len(turn_key) <= KEY_MAX):
            yield TurnFailed("invalid_request", f"a turn key is a string of 1 to {KEY_MAX} characters")
            return
        release = await self.keys.claim(sid, turn_key)
        handed_over = False  # an abandoned turn's outcome is kept, and its key released, by a later task
        try:
            try:
                session, _ = await self.session_of(sid, token, owner)
                answered = replay(session, turn_key, self.replica, self.engine.memory,
                                  lambda s: map_summary(self.engine, s), self.stored_state(sid))
                if answered is None:
                    if history is not None and [[m["role"], m["content"]] for m in session.messages] != history:
                        raise HistoryMismatch("the messages do not continue this session's history")
                    if isinstance(content, str) and not is_unicode(content):
                        raise InvalidRequest("the message is not valid Unicode text (a lone surrogate)")
                    if self.admit is not None:
                        await self.admit(session)
                    turns_before = len(session.turns)
                    params = checked_sampling(sampling, self.engine.sampling_defaults)
                    stream = await self.engine.chat(sid, content, params)
            except ChatError as exc:
                yield TurnFailed.of(exc)
                return
            except Exception:  # a bug, not the client's fault; the session is unchanged (nothing started)
                log.exception("turn of session %s could not start", sid)
                yield TurnFailed("internal_error", "the turn could not start")
                return
            for event in answered or ():
                yield event
            if answered is not None:
                return
            try:
                # The first event before anything goes out: whatever the caller does next, the engine's
                # turn has begun, so it ends (and frees the session) by itself.
                event = await anext(stream)
                yield TurnStarted(session_id=sid, replica=self.replica)
                while isinstance(event, (TextDelta, TurnStatus)):
                    yield Delta(event.text) if isinstance(event, TextDelta) else _status(event)
                    event = await anext(stream)
                await stream.aclose()
            except ChatError as exc:  # refused on the way (a full host tier): the session stays usable
                await self.persist(session)
                yield TurnFailed.of(exc)
                return
            except Exception as exc:  # the engine logged it; the session stays usable (cache rebuilt)
                await self.persist(session)
                yield TurnFailed("internal_error", f"the turn failed: {type(exc).__name__}")
                return
            except BaseException:
                # Abandoned by the consumer: the engine ended the turn as cancelled; keep that state.
                handed_over = True
                self.spawn(self._close_and_keep(stream, session, turn_key, turns_before, release))
                raise
            keep(session, turn_key, self.replica, turns_before)
            outcome, saved = await self.persist(session, True)
            if outcome in (MOVED, DELETED, DIVERGED):
                # Its record moved on (or went) while this copy ran the turn: the turn is not in the
                # record, so it is not acknowledged; sent again, it runs on the current state.
                yield TurnFailed.of(not_kept(sid, outcome))
                return
            if outcome is None and saved is not None and not saved.saved and self.take_back is not None:
                self.take_back(sid)  # in this replica's memory only, which the operator refuses: taken back
                yield TurnFailed.of(StoreUnavailable("Redis could not take this turn, so it was not kept; "
                                                     "send it again later"))
                return
            yield self._done(session, event, saved, params)
        finally:
            if not handed_over:
                release()

    async def _close_and_keep(self, stream, session: Session, turn_key: str | None, turns_before: int,
                              release) -> None:
        try:
            with contextlib.suppress(Exception):
                await stream.aclose()
            keep(session, turn_key, self.replica, turns_before)
            await self.persist(session)
        finally:
            release()

    def _done(self, session: Session, done: TurnDone, saved: Saved | None, params: SamplingParams) -> Done:
        return Done(
            finish_reason=done.finish_reason,
            usage=done.usage,
            memory=self.engine.memory(session),  # after the save, whose bytes written count for the turn
            replica=self.replica,
            session_id=session.id,
            ttft_ms=done.ttft_ms,
            latency_ms=done.latency_ms,
            memory_map=map_summary(self.engine, session),
            storage=saved,
            sampling=params.reported(),
        )


def not_kept(sid: str, outcome: str) -> ChatError:
    """What the caller of a turn that ran on a copy that must not serve again is told."""
    if outcome == DELETED:
        return SessionNotFound(f"no session {sid!r}")
    if outcome == DIVERGED:
        return SessionDiverged("Redis lost turns of this session that this replica had acknowledged, and another "
                               "replica went on from the older state: this turn was not kept, and the session "
                               "continues from the stored state; send it again")
    return SessionMoved("the session moved on on another replica; this turn was not kept: send it again")
