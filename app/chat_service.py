"""What one chat replica does: an ``Engine`` plus session secrets, persistence and restore.

The same object serves in-process (tests, ``serve --no-ray``) and inside a Ray Serve replica.
Every method speaks plain data (dicts, and the turn events of ``app.contract.events``) so that it
can cross a Ray boundary. Errors are ``app.contract.errors`` classes for unary calls and a
``TurnFailed`` event for streamed turns.

Access: a session answers only to its owner (the API key that made it, ``None`` without keys)
together with its token; an id that is malformed, unknown, or someone else's gets the same
``session_not_found``, before anything is looked up in Redis for it.

Persistence: with a ``SessionStore``, a session is written after creation and after every turn,
before the turn's ``done`` event leaves, so whoever sees ``done`` can rely on another replica
restoring that state. While Redis is unreachable turns go on in memory; the sessions whose save
failed are retried by the housekeeping loop until Redis takes them again (``unsaved_sessions``).

Memory: at most ``max_sessions`` sessions are held; idle ones that Redis keeps leave first (after
``idle_evict_s``, or earlier when room is needed), then new sessions get ``too_many_sessions``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from app.contract.errors import (
    ChatError,
    HistoryMismatch,
    InvalidRequest,
    InvalidSamplingParams,
    MessageTooLarge,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
    TooManySessions,
)
from app.contract.events import Delta, Done, TurnEvent, TurnFailed, TurnStarted
from app.contract.ids import is_session_id, new_session_token
from app.engine.engine import Engine
from app.engine.events import TextDelta, TurnDone
from app.engine.persistence import restore_session
from app.engine.sampling import SamplingParams
from app.engine.session import Session
from app.session_restore import (
    budget_of,
    create_with_id,
    export,
    is_unicode,
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
TICK_S = 1.0  # housekeeping period: unsaved sessions are retried this often while Redis is down
HEALTH_TIMEOUT_S = 2.0
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
        self.max_sessions = max_sessions
        self._digests: dict[str, str] = {}
        self._dirty: set[str] = set()  # sessions whose latest state Redis does not have
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
        last_push = 0.0
        while True:
            try:
                self._evict_idle()
                if self.store is not None:
                    await self._save_unsaved()
                    if time.monotonic() - last_push >= STATS_PUSH_S:
                        last_push = time.monotonic()
                        await self.store.put_replica_stats(self.replica, self.stats(), ttl_s=int(STATS_PUSH_S * 4))
            except Exception as exc:
                log.info("housekeeping: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(min(TICK_S, self.idle_evict_s / 2))

    async def _save_unsaved(self) -> None:
        for sid in list(self._dirty):
            session = self.engine.sessions.get(sid)
            if session is None:
                self._dirty.discard(sid)
            elif not session.busy:  # a busy one is saved at the end of its turn anyway
                await self._persist(session, quiet=True)

    def _evictable(self, sid: str, session: Session) -> bool:
        """Idle, and Redis has its latest state: dropping it from memory loses nothing."""
        return not session.busy and bool(self._versions.get(sid)) and sid not in self._dirty

    def _evict_idle(self) -> None:
        """Drop sessions idle too long from memory, but only those the store can give back."""
        if self.store is None:
            return
        cutoff = time.time() - self.idle_evict_s
        for sid, session in list(self.engine.sessions.items()):
            if session.last_used < cutoff and self._evictable(sid, session):
                self._forget(sid)

    def _make_room(self, keep: str | None = None) -> bool:
        """Bring the sessions held under ``max_sessions`` by dropping the least recently used
        idle ones that Redis keeps; False when that is not enough."""
        if self.max_sessions is None:
            return True
        held = self.engine.sessions
        if len(held) < self.max_sessions:
            return True
        for sid, session in sorted(held.items(), key=lambda item: item[1].last_used):
            if sid != keep and self._evictable(sid, session):
                self._forget(sid)
                if len(held) < self.max_sessions:
                    return True
        return False

    def _forget(self, sid: str) -> None:
        """Drop a session from this process's memory; its Redis state (if any) stays as it is."""
        self.engine.sessions.pop(sid, None)
        self._digests.pop(sid, None)
        self._versions.pop(sid, None)
        self._dirty.discard(sid)
        host = getattr(self.engine, "host_tier", None)
        if host is not None:
            # Not cache.release(): that deletes the Redis copies the stored state refers to.
            host.drop_session(sid)

    # --- lookup, restore and persistence -------------------------------------------------------
    def _check(self, session: Session, token: str | None, owner: str | None) -> None:
        if session.owner != owner or not token_matches(token, self._digests.get(session.id)):
            raise SessionNotFound(f"no session {session.id!r}")

    async def _session(self, sid: str, token: str | None, owner: str | None) -> tuple[Session, bool]:
        """The session if ``owner`` and ``token`` open it, restoring it from the store when it is not here.

        A missing session, a wrong token and another owner raise the same error, so ids cannot be probed.
        """
        if not is_session_id(sid):
            raise SessionNotFound("no such session")
        session = self.engine.sessions.get(sid)
        if session is not None:
            self._check(session, token, owner)
            if self.store is not None and not session.busy:
                session = await self._unless_stale(session)
        restored = False
        if session is None:
            session = await self._restore(sid, token, owner)
            restored = True
        self._check(session, token, owner)
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

    async def _restore(self, sid: str, token: str | None, owner: str | None) -> Session:
        if self.store is None:
            raise SessionNotFound(f"no session {sid!r}")
        async with self._restore_lock:
            session = self.engine.sessions.get(sid)
            if session is not None:
                return session
            try:
                loaded = await self.store.load(sid)
            except Exception as exc:
                log.warning("cannot restore %s: session store unreachable (%s)", sid, exc)
                raise StoreUnavailable("the session is not on this replica and Redis is unreachable") from None
            if (
                loaded is None
                or loaded[0].get("owner") != owner
                or not token_matches(token, loaded[0].get("token_sha256"))
            ):
                raise SessionNotFound(f"no session {sid!r}")
            data, version = loaded
            self._make_room(keep=sid)  # a stored session always comes back; others idle make way
            session = await self._engine_restore(sid, data) or restore(self.engine, data)
            session.owner = data.get("owner")
            self._digests[sid] = data["token_sha256"]
            self._versions[sid] = version
            log.info("restored session %s (v%d, %d tokens) on %s", sid, version, len(session.token_ids), self.replica)
            return session

    async def _engine_restore(self, sid: str, data: dict[str, Any]) -> Session | None:
        """The engine's own stored copy, when it is the same conversation as our record.

        It can bring a tiered session's KV back without re-prefilling; metadata-only modes gain
        nothing but lose nothing either. A copy that differs (a replica died between the two
        writes) is ignored in favour of our record, which the client's last ``done`` vouches for;
        so is one whose KV is no longer all in Redis (see ``_kv_complete``).
        """
        tier = getattr(self.engine, "redis", None)
        if tier is None:
            return None
        meta = tier.get_meta(sid)
        if not meta or meta.get("token_ids") != data["token_ids"] or len(meta.get("turns", [])) != len(data["turns"]):
            return None
        if not await self._kv_complete(sid, meta, tier):
            log.warning("session %s: stored KV incomplete (its replica died mid-turn); re-prefilling", sid)
            return None
        session = restore_session(tier, sid)
        if session is not None:
            self.engine.sessions[sid] = session
        return session

    async def _kv_complete(self, sid: str, meta: dict[str, Any], tier) -> bool:
        """Whether every KV key the engine's stored copy refers to is still in Redis.

        A turn rewrites each layer's primary set and page table at its end-of-turn save; a replica
        killed before the first save, or a cache released after it, leaves keys missing. (Cold pages
        themselves are never freed while the cache lives; one missing later is a rebuild at read time.)
        """
        kv = meta.get("kv")
        if kv is None:
            return True  # nothing but messages and token ids: the history is re-prefilled anyway
        try:
            layers = kv["cold"]
            names = [f"{kind}-l{i}" for i in range(len(layers)) for kind in ("primary", "index")]
            return await self.store.exists_all([tier.chunk_key(sid, name) for name in names])
        except Exception:  # an unreadable record, or Redis gone again: do not trust the KV
            return False

    async def _persist(self, session: Session, quiet: bool = False) -> None:
        if self.store is None or session.id not in self._digests:
            return
        async with self._save_lock:
            expected = self._versions.get(session.id)
            data, summ = record(session, self._digests[session.id]), summary(session, self.replica)
            try:
                ok = await self.store.save(data, summ, expected)
                if not ok and expected is not None and await self.store.version(session.id) is None:
                    # The record is gone (expired, or Redis came back empty): this copy is the truth.
                    expected = None
                    ok = await self.store.save(data, summ, None)
            except Exception as exc:
                self._dirty.add(session.id)
                if not quiet:
                    log.warning("could not save session %s (%s: %s); kept in memory, retried", session.id,
                                type(exc).__name__, exc)
                return
            self._dirty.discard(session.id)
            if ok:
                self._versions[session.id] = (expected or 0) + 1
                if quiet:
                    log.info("session %s saved again after a store outage", session.id)
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
        token = new_session_token()
        self._digests[session.id] = token_digest(token)
        self._versions[session.id] = None
        await self._persist(session)
        return self._info(session, token)

    # --- sessions ------------------------------------------------------------------------------
    def _admit(self) -> None:
        if not self._make_room():
            raise TooManySessions(
                f"this replica holds its limit of {self.max_sessions} sessions; delete one or try again later"
            )

    async def create(
        self,
        sid: str,
        mode: str | None = None,
        budget: int | None = None,
        system: str | None = None,
        owner: str | None = None,
    ):
        self.start()
        if sid in self.engine.sessions:
            raise InvalidRequest("session id already in use")
        limit = self.engine.settings.max_message_bytes
        if system is not None and len(system.encode("utf-8", "surrogatepass")) > limit:
            raise MessageTooLarge(f"the system prompt is over {limit} bytes")
        if system is not None and not is_unicode(system):
            raise InvalidRequest("the system prompt is not valid Unicode text (a lone surrogate)")
        self._admit()
        return await self._adopt(create_with_id(self.engine, sid, mode, budget, system, owner))

    async def import_session(self, sid: str, data: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        """A new session (new id and token) from exported data or from a bare message history."""
        self.start()
        self._admit()
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

    async def export(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]:
        session, _ = await self._session(sid, token, owner)
        return export(session)

    async def delete(self, sid: str, token: str | None, owner: str | None = None) -> None:
        session, _ = await self._session(sid, token, owner)
        if session.busy:
            raise SessionBusy("the session is generating; cancel it first")
        self.engine.delete_session(sid, owner)  # also frees its tiers and the engine's Redis keys
        self._forget(sid)
        if self.store is not None:
            await self.store.delete(sid)

    async def cancel(self, sid: str, token: str | None, owner: str | None = None) -> bool:
        session = self.engine.sessions.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise SessionNotFound(f"no session {sid!r}")
        self._check(session, token, owner)
        return self.engine.cancel(sid, owner)

    async def list_sessions(self, owner: str | None = None) -> list[dict[str, Any]]:
        held = self.engine.sessions.values()
        return [summary(s, self.replica) for s in held if s.id in self._digests and s.owner == owner]

    async def health(self) -> dict[str, Any]:
        """Redis as this replica sees it: the store's ping and the KV tier's own state."""
        tier = getattr(self.engine, "redis", None)
        if self.store is None and tier is None:
            return {}
        errors = []
        if self.store is not None:
            try:
                await asyncio.wait_for(self.store.ping(), HEALTH_TIMEOUT_S)
            except Exception as exc:
                errors.append(f"session store: {type(exc).__name__}: {exc}")
        if tier is not None:
            # The tier's ping also clears its error state once Redis answers again.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(tier.ping), HEALTH_TIMEOUT_S * 2)
            if not tier.healthy:
                errors.append(f"KV tier: {tier.last_error}")
        return {"redis": {"ok": not errors, "error": "; ".join(errors) or None}, "unsaved_sessions": len(self._dirty)}

    def _memory(self, session: Session) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.memory(session))

    def stats(self) -> dict[str, Any]:
        """Totals of this replica: bytes held per tier, entries moved between tiers, and the payload
        bytes each cold tier has served and taken since start (``host_bytes_read``, ...)."""
        totals = {"device_bytes": 0, "host_bytes": 0, "redis_bytes": 0, "promotions": 0, "demotions": 0, "spills": 0}
        for session in list(self.engine.sessions.values()):
            mem = self.engine.memory(session)
            for key in ("device_bytes", "host_bytes", "redis_bytes"):
                totals[key] += int(getattr(mem, key, 0) or 0)
        tiers = {"host": getattr(self.engine, "host_tier", None), "redis": getattr(self.engine, "redis", None)}
        for name, tier in tiers.items():
            tier_stats = getattr(tier, "stats", None)
            for key in ("promotions", "demotions", "spills"):
                totals[key] += int(getattr(tier_stats, key, 0) or 0)
            for key in ("bytes_read", "bytes_written"):
                totals[f"{name}_{key}"] = int(getattr(tier_stats, key, 0) or 0)
        busy = sum(1 for s in self.engine.sessions.values() if s.busy)
        # Device budget, peak, parks and refusals, batching figures (Engine.stats).
        return {"replica": self.replica, "sessions": len(self.engine.sessions), "busy": busy, **totals,
                **self.engine.stats()}

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
