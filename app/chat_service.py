"""What one chat replica does: an ``Engine`` plus session secrets, persistence and restore.

The same object serves in-process (tests, ``serve --no-ray``) and inside a Ray Serve replica.
Every method speaks plain data (dicts shaped like ``api.schemas``) so that it can cross a Ray
boundary. Errors become ``EngineError`` subclasses for unary calls and ``error`` events for
streamed turns.

Persistence: with a ``SessionStore``, a session is written after creation and after every turn,
before the turn's ``done`` event leaves, so whoever sees ``done`` can rely on another replica
restoring that state.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from api.errors import error_event
from api.schemas import DeltaEvent, DoneEvent, MemoryModel, UsageModel
from app.engine.engine import Engine
from app.engine.errors import EngineError, InvalidRequest, SessionBusy, SessionNotFound
from app.engine.events import TextDelta, TurnDone
from app.engine.persistence import restore_session
from app.engine.sampling import SamplingParams
from app.engine.session import Session
from app.session_restore import (
    budget_of,
    create_with_id,
    export,
    record,
    restore,
    seed_session,
    summary,
    token_digest,
    token_matches,
)
from app.session_store import SessionStore

log = logging.getLogger(__name__)
STATS_PUSH_S = 5.0


class HistoryMismatch(InvalidRequest):
    code = "history_mismatch"


def new_token() -> str:
    return secrets.token_urlsafe(24)


class ChatService:
    def __init__(
        self,
        engine: Engine,
        replica_id: str | None = None,
        store: SessionStore | None = None,
        idle_evict_s: float = 3600.0,
    ):
        self.engine = engine
        self.replica = replica_id or f"local-{os.getpid()}"
        self.store = store
        self.idle_evict_s = idle_evict_s
        self._digests: dict[str, str] = {}
        # Store version each local session was last saved or loaded at; None = never saved.
        self._versions: dict[str, int | None] = {}
        self._restore_lock = asyncio.Lock()
        self._save_lock = asyncio.Lock()
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
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.drop_replica_stats(self.replica)
            await self.store.close()
        self.engine.close()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _housekeeping(self) -> None:
        period = min(STATS_PUSH_S, self.idle_evict_s / 2)
        while True:
            try:
                self._evict_idle()
                if self.store is not None:
                    await self.store.put_replica_stats(self.replica, self.stats(), ttl_s=int(STATS_PUSH_S * 4))
            except Exception:
                log.warning("housekeeping failed", exc_info=True)
            await asyncio.sleep(period)

    def _evict_idle(self) -> None:
        """Drop sessions idle too long from memory, but only those the store can give back."""
        if self.store is None:
            return
        cutoff = time.time() - self.idle_evict_s
        for sid, session in list(self.engine.sessions.items()):
            if not session.busy and session.last_used < cutoff and self._versions.get(sid):
                self._forget(sid)

    def _forget(self, sid: str) -> None:
        self.engine.sessions.pop(sid, None)
        self._digests.pop(sid, None)
        self._versions.pop(sid, None)

    # --- lookup, restore and persistence -------------------------------------------------------
    async def _session(self, sid: str, token: str | None) -> tuple[Session, bool]:
        """The session if ``token`` opens it, restoring it from the store when it is not here.

        A missing session and a wrong token raise the same error, so ids cannot be probed.
        """
        if not isinstance(sid, str):
            raise SessionNotFound("no such session")
        session = self.engine.sessions.get(sid)
        if session is not None and self.store is not None and not session.busy:
            session = await self._unless_stale(session)
        restored = False
        if session is None:
            session = await self._restore(sid, token)
            restored = True
        if not token_matches(token, self._digests.get(sid)):
            raise SessionNotFound(f"no session {sid!r}")
        return session, restored

    async def _unless_stale(self, session: Session) -> Session | None:
        try:
            stored = await self.store.version(session.id)
        except Exception:
            log.warning("session store unreachable; using the local copy of %s", session.id, exc_info=True)
            return session
        local = self._versions.get(session.id)
        if stored is None:
            self._versions[session.id] = None  # expired from the store: the next save recreates it
            return session
        if local is None or stored > local:
            log.info("local copy of session %s is stale (v%s < v%s); restoring", session.id, local, stored)
            self._forget(session.id)
            return None
        return session

    async def _restore(self, sid: str, token: str | None) -> Session:
        if self.store is None:
            raise SessionNotFound(f"no session {sid!r}")
        async with self._restore_lock:
            session = self.engine.sessions.get(sid)
            if session is not None:
                return session
            loaded = await self.store.load(sid)
            if loaded is None or not token_matches(token, loaded[0].get("token_sha256")):
                raise SessionNotFound(f"no session {sid!r}")
            data, version = loaded
            session = self._engine_restore(sid, data) or restore(self.engine, data)
            self._digests[sid] = data["token_sha256"]
            self._versions[sid] = version
            log.info("restored session %s (v%d, %d tokens) on %s", sid, version, len(session.token_ids), self.replica)
            return session

    def _engine_restore(self, sid: str, data: dict[str, Any]) -> Session | None:
        """The engine's own stored copy, when it is the same conversation as our record.

        It can bring a tiered session's KV back without re-prefilling; metadata-only modes gain
        nothing but lose nothing either. A copy that differs (a replica died between the two
        writes) is ignored in favour of our record, which the client's last ``done`` vouches for.
        """
        tier = getattr(self.engine, "redis", None)
        if tier is None:
            return None
        meta = tier.get_meta(sid)
        if not meta or meta.get("token_ids") != data["token_ids"] or len(meta.get("turns", [])) != len(data["turns"]):
            return None
        session = restore_session(self.engine, sid)
        if session is not None:
            self.engine.sessions[sid] = session
        return session

    async def _persist(self, session: Session) -> None:
        if self.store is None or session.id not in self._digests:
            return
        async with self._save_lock:
            expected = self._versions.get(session.id)
            try:
                ok = await self.store.save(
                    record(session, self._digests[session.id]), summary(session, self.replica), expected
                )
            except Exception:
                log.warning("could not save session %s", session.id, exc_info=True)
                return
            if ok:
                self._versions[session.id] = (expected or 0) + 1
                with contextlib.suppress(Exception):  # fresh totals for /metrics; the loop retries anyway
                    await self.store.put_replica_stats(self.replica, self.stats(), ttl_s=int(STATS_PUSH_S * 4))
            else:
                # Another replica saved a newer state: this copy must not serve again.
                log.warning("session %s moved on elsewhere; dropping the local copy", session.id)
                self._versions[session.id] = -1

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
        token = new_token()
        self._digests[session.id] = token_digest(token)
        self._versions[session.id] = None
        await self._persist(session)
        return self._info(session, token)

    # --- sessions ------------------------------------------------------------------------------
    async def create(self, sid: str, mode: str | None = None, budget: int | None = None, system: str | None = None):
        self.start()
        if sid in self.engine.sessions:
            raise InvalidRequest("session id already in use")
        return await self._adopt(create_with_id(self.engine, sid, mode, budget, system))

    async def import_session(self, sid: str, data: dict[str, Any]) -> dict[str, Any]:
        """A new session (new id and token) from exported data or from a bare message history."""
        self.start()
        session = seed_session(
            self.engine,
            sid,
            mode=data.get("mode"),
            budget=data.get("budget"),
            messages=data.get("messages") or [],
            token_ids=data.get("token_ids"),
        )
        return await self._adopt(session)

    async def resume(self, sid: str, token: str | None) -> dict[str, Any]:
        self.start()
        session, restored = await self._session(sid, token)
        return self._info(session, token, restored)

    async def get(self, sid: str, token: str | None) -> dict[str, Any]:
        session, _ = await self._session(sid, token)
        cache = session.cache
        return {
            **summary(session, self.replica),
            "messages": session.messages,
            "tokens": {
                "history": len(session.token_ids),
                "cached": session.fed_tokens,
                "device": cache.kept_tokens() if cache is not None else 0,
            },
            "memory": self._memory(session),
            "turn_stats": [
                {k: getattr(t, k) for k in ("prompt_tokens", "prefilled_tokens", "generated_tokens",
                                             "finish_reason", "ttft_ms", "latency_ms")}
                for t in session.turns
            ],
            "busy": session.busy,
        }

    async def export(self, sid: str, token: str | None) -> dict[str, Any]:
        session, _ = await self._session(sid, token)
        return export(session)

    async def delete(self, sid: str, token: str | None) -> None:
        session, _ = await self._session(sid, token)
        if session.busy:
            raise SessionBusy("the session is generating; cancel it first")
        self.engine.delete_session(sid)  # also frees its tiers and the engine's Redis keys
        self._forget(sid)
        if self.store is not None:
            await self.store.delete(sid)

    async def cancel(self, sid: str, token: str | None) -> bool:
        session = self.engine.sessions.get(sid) if isinstance(sid, str) else None
        if session is None or not token_matches(token, self._digests.get(sid)):
            raise SessionNotFound(f"no session {sid!r}")
        return self.engine.cancel(sid)

    async def list_sessions(self) -> list[dict[str, Any]]:
        return [summary(s, self.replica) for s in self.engine.sessions.values() if s.id in self._digests]

    def _memory(self, session: Session) -> dict[str, Any]:
        return MemoryModel.model_validate(self.engine.memory(session), from_attributes=True).model_dump()

    def stats(self) -> dict[str, Any]:
        totals = {"device_bytes": 0, "host_bytes": 0, "redis_bytes": 0, "promotions": 0, "demotions": 0}
        for session in list(self.engine.sessions.values()):
            mem = self.engine.memory(session)
            for key in ("device_bytes", "host_bytes", "redis_bytes"):
                totals[key] += int(getattr(mem, key, 0) or 0)
        for tier in (getattr(self.engine, "host_tier", None), getattr(self.engine, "redis", None)):
            tier_stats = getattr(tier, "stats", None)
            for key in ("promotions", "demotions"):
                totals[key] += int(getattr(tier_stats, key, 0) or 0)
        busy = sum(1 for s in self.engine.sessions.values() if s.busy)
        return {"replica": self.replica, "sessions": len(self.engine.sessions), "busy": busy, **totals}

    # --- turns ---------------------------------------------------------------------------------
    async def chat(
        self,
        sid: str,
        token: str | None,
        content: str,
        sampling: dict[str, Any] | None = None,
        history: list[list[str]] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream one turn: ``start`` (internal: the turn was accepted, and where), ``delta``
        events, then ``done``; or a single ``error`` when the turn cannot start.

        ``history``, when given, is the [role, content] list the caller believes the session
        holds; a different history ends the call with ``history_mismatch`` before any work.
        """
        self.start()
        try:
            session, _ = await self._session(sid, token)
            if history is not None and [[m["role"], m["content"]] for m in session.messages] != history:
                raise HistoryMismatch("the messages do not continue this session's history")
            params = SamplingParams.parse(**(sampling or {}))
            stream = await self.engine.chat(sid, content, params)
        except EngineError as exc:
            yield error_event(exc.code, exc.message)
            return
        yield {"type": "start", "session_id": sid, "replica": self.replica}
        done: TurnDone | None = None
        try:
            async for event in stream:
                if isinstance(event, TextDelta):
                    yield DeltaEvent(text=event.text).model_dump()
                else:
                    done = event
        except Exception as exc:  # the engine logged it; the session stays usable (cache rebuilt)
            await self._persist(session)
            yield error_event("internal_error", f"the turn failed: {type(exc).__name__}")
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

    def _done(self, session: Session, done: TurnDone) -> dict[str, Any]:
        return DoneEvent(
            finish_reason=done.finish_reason,
            usage=UsageModel.model_validate(done.usage, from_attributes=True),
            memory=MemoryModel.model_validate(done.memory, from_attributes=True),
            replica=self.replica,
            session_id=session.id,
            ttft_ms=done.ttft_ms,
            latency_ms=done.latency_ms,
        ).model_dump()
