"""What one chat replica does: an ``Engine`` behind the session verbs its callers use.

The same object serves in-process (tests, ``serve --no-ray``) and inside a Ray Serve replica.
Every method speaks plain data (dicts, and the turn events of ``app.contract.events``) so that it
can cross a Ray boundary. Errors are ``app.contract.errors`` classes for unary calls and a
``TurnFailed`` event for streamed turns.

The jobs behind the verbs live in their own modules: who may open a session
(``app.session_access``), which sessions stay in memory (``app.session_residency``), and the
compare-and-set records in Redis that let any replica restore a session (``app.session_repository``).
This class puts them in order for each verb and runs the housekeeping loop (idle eviction, saves
that failed while Redis was down, this replica's stats).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from app.contract.errors import (
    ChatError,
    HistoryMismatch,
    InvalidRequest,
    InvalidSamplingParams,
    SessionBusy,
)
from app.contract.events import Delta, Done, TurnEvent, TurnFailed, TurnStarted
from app.engine.engine import Engine
from app.engine.events import TextDelta, TurnDone
from app.engine.sampling import SamplingParams
from app.engine.session import Session
from app.replica_status import redis_health, replica_totals
from app.session_access import SessionAccess, refuse
from app.session_repository import SessionRepository
from app.session_residency import Residency
from app.session_restore import (
    budget_of,
    check_new,
    create_with_id,
    detail,
    export,
    is_unicode,
    seed_session,
    summary,
)
from app.session_store import SessionStore

log = logging.getLogger(__name__)
STATS_PUSH_S = 5.0
TICK_S = 1.0  # housekeeping period: unsaved sessions are retried this often while Redis is down
SAMPLING_FLOOR = 1e-6
MAX_SEED = 2**63 - 1


def checked_sampling(sampling: dict[str, Any] | None) -> SamplingParams:
    """``SamplingParams`` plus the bounds the sampler itself needs (found by fuzzing: smaller values
    become 0 in float32, or push the logits to inf, and the turn fails)."""
    params = SamplingParams.parse(**(sampling or {}))
    if 0 < params.temperature < SAMPLING_FLOOR or params.top_p < SAMPLING_FLOOR:
        raise InvalidSamplingParams(f"temperature (when not 0) and top_p must be at least {SAMPLING_FLOOR:g}")
    if params.seed is not None and params.seed > MAX_SEED:
        raise InvalidSamplingParams(f"seed must be at most {MAX_SEED} (torch seeds are 64-bit)")
    return params


class ChatService:
    def __init__(
        self,
        engine: Engine,
        replica_id: str | None = None,
        store: SessionStore | None = None,
        idle_evict_s: float = 3600.0,
        max_sessions: int | None = None,
    ):
        self.engine = engine
        self.replica = replica_id or f"local-{os.getpid()}"
        self.store = store
        self.idle_evict_s = idle_evict_s
        self.access = SessionAccess()
        self.repository = SessionRepository(engine, store, self.replica, self.stats) if store is not None else None
        self.residency = Residency(engine, self._can_leave, self._forget, max_sessions, idle_evict_s)
        self._restore_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._housekeeper: asyncio.Task | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start housekeeping on the running loop (idempotent, so callers may call it per request)."""
        if self._housekeeper is None or self._housekeeper.done():
            self._housekeeper = asyncio.get_running_loop().create_task(self._housekeeping())

    async def close(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(BaseException):
                await self._housekeeper
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.repository is not None:
            await self.repository.close()
        self.engine.close()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _housekeeping(self) -> None:
        last_push = 0.0
        while True:
            try:
                if self.repository is not None:
                    self.residency.evict_idle()
                    await self.repository.save_unsaved(self.access.digest)
                    if time.monotonic() - last_push >= STATS_PUSH_S:
                        last_push = time.monotonic()
                        await self.repository.push_stats()
            except Exception as exc:  # housekeeping must go on whatever one round hit
                log.info("housekeeping: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(min(TICK_S, self.idle_evict_s / 2))

    # --- the jobs, put together ----------------------------------------------------------------
    def _can_leave(self, session: Session) -> bool:
        """Idle, and Redis has its latest state: dropping it from memory loses nothing."""
        return self.repository is not None and not session.busy and self.repository.stored(session.id)

    def _forget(self, sid: str) -> None:
        """Drop a session from this process (device memory and host-tier pages freed); Redis keeps its state."""
        self.engine.drop(sid)
        self.access.forget(sid)
        if self.repository is not None:
            self.repository.forget(sid)

    async def _persist(self, session: Session, quiet: bool = False) -> None:
        digest = self.access.digest(session.id)
        if self.repository is not None and digest is not None:
            await self.repository.save(session, digest, quiet)

    async def _session(self, sid: str, token: str | None, owner: str | None) -> tuple[Session, bool]:
        """The session if ``owner`` and ``token`` open it, restoring it from the store when it is not here.

        A missing session, a wrong token and another owner raise the same error, so ids cannot be probed.
        """
        self.access.check_id(sid)
        session = self.engine.sessions.get(sid)
        if session is not None:
            self.access.check(session, token, owner)
            if self.repository is not None and not session.busy and await self.repository.is_stale(session):
                self._forget(sid)
                session = None
        restored = session is None
        if session is None:
            session = await self._restore(sid, token, owner)
        self.access.check(session, token, owner)
        return session, restored

    async def _restore(self, sid: str, token: str | None, owner: str | None) -> Session:
        if self.repository is None:
            raise refuse(sid)
        async with self._restore_lock:
            session = self.engine.sessions.get(sid)
            if session is not None:
                return session
            loaded = await self.repository.load(sid)
            self.access.check_record(sid, loaded[0] if loaded else None, token, owner)
            data, version = loaded
            self.residency.make_room(keep=sid)  # a stored session always comes back; others idle make way
            session = await self.repository.revive(sid, data, version)
            self.access.grant(sid, data["token_sha256"])
            return session

    def _info(self, session: Session, token: str, restored: bool = False) -> dict[str, Any]:
        return {
            "session_id": session.id,
            "token": token,
            "mode": session.mode,
            "budget": budget_of(session),
            "replica": self.replica,
            "restored": restored,
        }

    async def _adopt(self, session: Session) -> dict[str, Any]:
        token = self.access.issue(session.id)
        if self.repository is not None:
            self.repository.track(session.id)
        await self._persist(session)
        return self._info(session, token)

    # --- sessions ------------------------------------------------------------------------------
    async def create(
        self,
        sid: str,
        mode: str | None = None,
        budget: int | None = None,
        system: str | None = None,
        owner: str | None = None,
    ):
        self.start()
        check_new(self.engine, sid, system)
        self.residency.admit()
        return await self._adopt(create_with_id(self.engine, sid, mode, budget, system, owner))

    async def import_session(self, sid: str, data: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        """A new session (new id and token) from exported data or from a bare message history."""
        self.start()
        self.residency.admit()
        session = seed_session(
            self.engine,
            sid,
            mode=data.get("mode"),
            budget=data.get("budget"),
            messages=data.get("messages") or [],
            token_ids=data.get("token_ids"),
            owner=owner,
        )
        return await self._adopt(session)

    async def resume(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]:
        self.start()
        session, restored = await self._session(sid, token, owner)
        return self._info(session, token, restored)

    async def get(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]:
        session, _ = await self._session(sid, token, owner)
        return detail(session, self.replica, dataclasses.asdict(self.engine.memory(session)))

    async def export(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]:
        session, _ = await self._session(sid, token, owner)
        return export(session)

    async def delete(self, sid: str, token: str | None, owner: str | None = None) -> None:
        session, _ = await self._session(sid, token, owner)
        if session.busy:
            raise SessionBusy("the session is generating; cancel it first")
        self.engine.delete_session(sid, owner)  # also frees its tiers and the engine's Redis keys
        self._forget(sid)
        if self.repository is not None:
            await self.repository.delete(sid)

    async def cancel(self, sid: str, token: str | None, owner: str | None = None) -> bool:
        session = self.engine.sessions.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise refuse(sid)
        self.access.check(session, token, owner)
        return self.engine.cancel(sid, owner)

    async def list_sessions(self, owner: str | None = None) -> list[dict[str, Any]]:
        held = self.engine.sessions.values()
        return [summary(s, self.replica) for s in held if self.access.holds(s.id) and s.owner == owner]

    async def health(self) -> dict[str, Any]:
        """Redis as this replica sees it (``{}`` without Redis), and how many sessions it has not saved."""
        unsaved = self.repository.unsaved if self.repository is not None else 0
        return await redis_health(self.engine, self.store, unsaved)

    def stats(self) -> dict[str, Any]:
        return replica_totals(self.engine, self.replica)

    # --- turns ---------------------------------------------------------------------------------
    async def chat(
        self,
        sid: str,
        token: str | None,
        content: str,
        sampling: dict[str, Any] | None = None,
        history: list[list[str]] | None = None,
        owner: str | None = None,
    ) -> AsyncIterator[TurnEvent]:
        """Stream one turn: ``TurnStarted`` (the turn was accepted, and where), ``Delta``s, then
        ``Done``; or a single ``TurnFailed`` when the turn cannot start.

        ``history``, when given, is the [role, content] list the caller believes the session
        holds; a different history ends the call with ``history_mismatch`` before any work.
        """
        self.start()
        try:
            session, _ = await self._session(sid, token, owner)
            if history is not None and [[m["role"], m["content"]] for m in session.messages] != history:
                raise HistoryMismatch("the messages do not continue this session's history")
            if isinstance(content, str) and not is_unicode(content):
                raise InvalidRequest("the message is not valid Unicode text (a lone surrogate)")
            params = checked_sampling(sampling)
            stream = await self.engine.chat(sid, content, params, owner)
        except ChatError as exc:
            yield TurnFailed.of(exc)
            return
        except Exception:  # a bug, not the client's fault; the session is unchanged (nothing started)
            log.exception("turn of session %s could not start", sid)
            yield TurnFailed("internal_error", "the turn could not start")
            return
        yield TurnStarted(session_id=sid, replica=self.replica)
        done: TurnDone | None = None
        try:
            async for event in stream:
                if isinstance(event, TextDelta):
                    yield Delta(event.text)
                else:
                    done = event
        except Exception as exc:  # the engine logged it; the session stays usable (cache rebuilt)
            await self._persist(session)
            yield TurnFailed("internal_error", f"the turn failed: {type(exc).__name__}")
            return
        except BaseException:
            # Abandoned by the consumer: the engine ended the turn as cancelled; keep that state.
            self._spawn(self._close_and_persist(stream, session))
            raise
        await self._persist(session)
        yield self._done(session, done)

    async def _close_and_persist(self, stream, session: Session) -> None:
        with contextlib.suppress(Exception):
            await stream.aclose()
        await self._persist(session)

    def _done(self, session: Session, done: TurnDone) -> Done:
        return Done(
            finish_reason=done.finish_reason,
            usage=done.usage,
            memory=done.memory,
            replica=self.replica,
            session_id=session.id,
            ttft_ms=done.ttft_ms,
            latency_ms=done.latency_ms,
        )
