"""What one chat replica does: an ``Engine`` behind the session verbs (``app.contract.service``).

The same object serves in-process (tests, ``serve --no-ray``) and inside a Ray Serve replica, always
through ``api.service_client.ServiceClient``. Every method speaks plain data (dicts, and the turn
events of ``app.contract.events``) so that it can cross a Ray boundary. Errors are
``app.contract.errors`` classes for unary calls and a ``TurnFailed`` event for streamed turns.

The jobs behind the verbs live in their own modules: who may open a session
(``app.session_access``), which sessions stay in memory (``app.session_residency``), the one
compare-and-set record per session in Redis that lets any replica restore it
(``app.session_repository``), and turns that run at most once (``app.session_turns``). This class puts
them in order for each verb and runs the housekeeping loop (idle eviction, letting go of sessions parked
off a full device, saves that failed while Redis was down, copies that must not serve again, what Redis
promises after a reconnect, this replica's stats); the engine renews the KV it wrote and no record
names yet (``app.engine.renewal``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.contract.errors import QuotaExceeded, SessionBusy, SessionDiverged, StoreUnavailable
from app.contract.events import NOT_SAVED, Saved, TurnEvent
from app.engine.engine import Engine
from app.engine.session import Session
from app.placement import RELEASED_KEEP, routing_stats
from app.replica_status import redis_health, replica_room, replica_totals
from app.session_access import SessionAccess, refuse
from app.session_map import session_map
from app.session_fence import DELETED, DIVERGED, MOVED_ON
from app.session_repository import SessionRepository
from app.session_residency import Residency
from app.session_restore import check_new, create_with_id, detail, export, info, seed_session, summary
from app.session_store import SessionStore
from app.session_turns import Turns

log = logging.getLogger(__name__)
STATS_PUSH_S = 5.0
TICK_S = 1.0  # housekeeping period: unsaved sessions are retried this often while Redis is down
USAGE_TTL_S = 2.0  # how long an owner's usage read for its quota stands


@dataclass(frozen=True)
class StoragePolicy:
    """What a replica asks of the session store beyond saving: ``refuse_unsaved``, take back a turn that
    cannot be saved rather than answer it from memory; quotas per owner (an API key), 0 for none."""

    refuse_unsaved: bool = False
    quota_sessions: int = 0
    quota_bytes: int = 0


class ChatService:
    def __init__(
        self,
        engine: Engine,
        replica_id: str | None = None,
        store: SessionStore | None = None,
        idle_evict_s: float = 3600.0,
        max_sessions: int | None = None,
        policy: StoragePolicy | None = None,
    ):
        self.engine = engine
        self.replica = replica_id or f"local-{os.getpid()}"
        self.store = store
        self.idle_evict_s = idle_evict_s
        self.policy = policy or StoragePolicy()
        self.access = SessionAccess()
        self.repository = SessionRepository(engine, store, self.replica, self.totals) if store is not None else None
        self.residency = Residency(engine, self._can_leave, self._forget, max_sessions, idle_evict_s)
        take_back = self._take_back if self.policy.refuse_unsaved and store is not None else None
        self.turns = Turns(engine, self.replica, self._session, self._persist, self._spawn, self._admit_turn, take_back,
                           self._stored_state)
        self._reconnects = 0  # the store client's count when its configuration was last read
        self._restore_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._housekeeper: asyncio.Task | None = None
        # Sessions let go lately while parked (the latest last): the router must not count this replica
        # as their holder, though Ray still lists them among its multiplexed ids.
        self.released: OrderedDict[str, None] = OrderedDict()

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
        self.engine.close()  # last: its Redis connection is the records' too

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _housekeeping(self) -> None:
        last_push = 0.0
        while True:
            try:
                if self.repository is not None:
                    await self._check_store()
                    self.residency.evict_idle()
                    self._let_parked_go()
                    await self.repository.save_unsaved(self.access.digest)
                    await self._drop_stale()
                    if time.monotonic() - last_push >= STATS_PUSH_S:
                        last_push = time.monotonic()
                        await self.repository.push_stats()
            except Exception as exc:  # housekeeping must go on whatever one round hit
                log.info("housekeeping: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(min(TICK_S, self.idle_evict_s / 2))

    async def _check_store(self) -> None:
        """Once Redis answers again after failing (a restart, a failover to another primary), read what it
        promises again: an evicting policy stops saves (sessions go on in memory, ``saved: false``)."""
        client = self.store.client
        if client.reconnects == self._reconnects:
            return
        self._reconnects = client.reconnects
        refusal = await asyncio.to_thread(self.engine.check_store)
        if refusal != self.repository.refusal:
            (log.error if refusal else log.warning)("session store: %s", refusal or "saves allowed again")
        self.repository.refusal = refusal

    # --- the jobs, put together ----------------------------------------------------------------
    def _can_leave(self, session: Session) -> bool:
        """Idle, and Redis has its latest state: dropping it from memory loses nothing."""
        return self.repository is not None and not session.busy and self.repository.stored(session.id)

    def _let_parked_go(self) -> None:
        """Let go of the sessions parked off the full device whose state Redis has, and report them
        released (``routing_stats``): their next turn goes where there is room, which restores them."""
        for sid in self.residency.let_parked_go():
            self.released[sid] = None
            self.released.move_to_end(sid)
            while len(self.released) > RELEASED_KEEP:
                self.released.popitem(last=False)

    def _take_back(self, sid: str) -> None:
        """A finished turn Redis could not take, refused: this copy goes, so that the session is its stored
        state again. One busy with a turn begun meanwhile goes once that turn's save finds it stale."""
        session = self.engine.sessions.get(sid)
        if session is not None and session.busy:
            self.repository.stale.add(sid)
        else:
            self._forget(sid)

    def _forget(self, sid: str) -> None:
        """Drop a session from this process (device memory and host-tier pages freed); Redis keeps its state."""
        self.engine.drop(sid)
        self._untrack(sid)

    def _untrack(self, sid: str) -> None:
        """This replica no longer grants or saves the session (it left the engine)."""
        self.access.forget(sid)
        if self.repository is not None:
            self.repository.forget(sid)

    async def _persist(self, session: Session, tells: bool = False) -> tuple[str | None, Saved | None]:
        """Save the session (``SessionRepository.save``'s outcome and what it promises; (None, None)
        without a store). ``tells``: the caller tells its client the outcome."""
        digest = self.access.digest(session.id)
        if self.repository is None:
            return None, None
        if digest is None:
            return None, NOT_SAVED
        return await self.repository.save(session, digest, tells=tells)

    def _stored_state(self, sid: str) -> Saved | None:
        """What is saved of a session now, for a turn answered again from what the session kept: its record
        holds its latest state or not (how durably is not known here: as in Redis's memory)."""
        if self.repository is None:
            return None
        return Saved(True, False, "memory") if self.repository.stored(sid) else NOT_SAVED

    async def _admit_turn(self, session: Session) -> None:
        """Before a turn runs: its owner's stored bytes within quota; where unsaved turns are refused,
        Redis able to take it."""
        if self.repository is None:
            return
        if self.policy.refuse_unsaved and not self.repository.can_save(session.id):
            raise StoreUnavailable("Redis cannot take a turn now, and this server does not keep turns it cannot "
                                   "save; send it again later")
        if self.policy.quota_bytes:
            _, stored = await self._usage(session.owner, USAGE_TTL_S)  # updated by the owner's every save
            if stored >= self.policy.quota_bytes:
                raise QuotaExceeded(f"this key's sessions keep {stored} bytes in Redis, its quota is "
                                    f"{self.policy.quota_bytes}: delete sessions to go on")

    async def _admit_session(self, owner: str | None) -> None:
        """Before a session is made: its owner's sessions within quota."""
        if self.repository is None or not self.policy.quota_sessions:
            return
        count, _ = await self._usage(owner)
        if count >= self.policy.quota_sessions:
            raise QuotaExceeded(f"this key keeps {count} sessions, its quota is {self.policy.quota_sessions}: "
                                "delete sessions to make new ones")

    async def _usage(self, owner: str | None, max_age_s: float = 0.0) -> tuple[int, int]:
        """What the owner keeps in Redis (``OwnerIndex.usage``). Unreadable (its shard out): no limit is
        applied, rather than stopping every turn of the owner on the sessions' live shards."""
        try:
            return await self.store.owners.usage(owner, max_age_s)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("quotas of %s not checked: %s: %s", owner, type(exc).__name__, exc)
            return 0, 0

    async def _drop_stale(self) -> None:
        """Let go of the copies held here that must not serve again (another replica saved since, or the
        store lost saves of this copy that another replica went on from), or that were deleted: an idle
        stale copy must not be the one served if Redis becomes unreachable (a busy one learns at its save)."""
        stale, deleted = await self.repository.refresh()
        for sid in stale + deleted:
            session = self.engine.sessions.get(sid)
            if session is not None and session.busy:
                continue
            if sid in deleted:
                await self._purge(sid)
            else:
                self._forget(sid)

    async def _session(self, sid: str, token: str | None, owner: str | None) -> tuple[Session, bool]:
        """The session if ``owner`` and ``token`` open it, restoring it from the store when it is not here.

        A missing session, a wrong token and another owner raise the same error, so ids cannot be probed.
        A copy the store lost saves of, while another replica went on, is dropped and its caller told
        once (``session_diverged``); the next call restores the stored state.
        """
        self.access.check_id(sid)
        session = self.engine.sessions.get(sid)
        if session is not None:
            self.access.check(session, token, owner)
            verdict = await self.repository.check(sid) if self.repository is not None and not session.busy else None
            if verdict == DELETED:  # deleted elsewhere: this copy never serves again
                await self._purge(sid)
                raise refuse(sid)
            if verdict in (MOVED_ON, DIVERGED):
                self._forget(sid)
                session = None
            elif self.engine.sessions.get(sid) is not session:
                session = None  # let go while this waited (parked off a full device): restored below
        if session is None and self.repository is not None and sid in self.repository.divergences:
            lost = self.repository.divergences.pop(sid)
            raise SessionDiverged(f"Redis lost {lost} save(s) of this session that a replica had acknowledged, and "
                                  "another replica went on from the older state: those turns are lost, and the "
                                  "session continues from the stored state")
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
            data, stored = loaded
            self.residency.make_room(keep=sid)  # a stored session always comes back; others idle make way
            session = await self.repository.revive(sid, data, stored)
            self.access.grant(sid, data["token_sha256"])
            self.released.pop(sid, None)  # held here again
            return session

    async def _adopt(self, session: Session) -> dict[str, Any]:
        token = self.access.issue(session.id)
        self.released.pop(session.id, None)
        if self.repository is not None:
            self.repository.track(session.id)
        _, saved = await self._persist(session)
        if saved is not None and not saved.saved and self.policy.refuse_unsaved:
            self._forget(session.id)
            raise StoreUnavailable("Redis cannot take a new session now, and this server does not keep sessions "
                                   "it cannot save; try again later")
        return info(session, token, self.replica, sampling=self.engine.sampling_defaults)

    # --- sessions ------------------------------------------------------------------------------
    async def create_session(
        self,
        sid: str,
        mode: str | None = None,
        budget: int | None = None,
        system: str | None = None,
        owner: str | None = None,
    ):
        self.start()
        check_new(self.engine, sid, system)
        await self._admit_session(owner)
        self.residency.admit()
        return await self._adopt(create_with_id(self.engine, sid, mode, budget, system, owner))

    async def import_session(self, sid: str, data: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        """A new session (new id and token) from exported data or from a bare message history."""
        self.start()
        await self._admit_session(owner)
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

    async def resume_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]:
        self.start()
        session, restored = await self._session(sid, token, owner)
        return info(session, token, self.replica, restored, self.engine.sampling_defaults)

    async def get_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]:
        session, _ = await self._session(sid, token, owner)
        return detail(session, self.replica, dataclasses.asdict(self.engine.memory(session)))

    async def export_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]:
        session, _ = await self._session(sid, token, owner)
        return export(session)

    async def memory_map(self, sid: str, token: str | None, owner: str | None = None, text: bool = False) -> dict[str, Any]:
        session, _ = await self._session(sid, token, owner)
        return await session_map(self.engine, session, text)

    async def delete_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any] | None:
        """Delete for good: the record's tombstone first, which deletes the KV it names in the same step
        (no save in flight, here or on another replica, can bring it back; Redis unreachable, nothing is
        deleted and the caller is told), then the session leaves this replica with its host slots and
        what it wrote that no record names. What the tombstone's write promises (as a turn's ``storage``),
        or None without a store."""
        session, _ = await self._session(sid, token, owner)
        if session.busy:
            raise SessionBusy("the session is generating; cancel it first")
        saved = await self.repository.delete(sid, session.owner) if self.repository is not None else None
        await self._purge(sid)
        return dataclasses.asdict(saved) if saved is not None else None

    async def _purge(self, sid: str) -> None:
        """A deleted session leaves this replica (the record is a tombstone, its KV gone with it)."""
        await self.engine.purge(sid)
        self._untrack(sid)

    async def cancel_turn(self, sid: str, token: str | None, owner: str | None = None) -> bool:
        session = self.engine.sessions.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise refuse(sid)
        self.access.check(session, token, owner)
        return self.engine.cancel(sid)

    async def list_sessions(self, owner: str | None = None) -> list[dict[str, Any]]:
        held = self.engine.sessions.values()
        return [summary(s, self.replica) for s in held if self.access.holds(s.id) and s.owner == owner]

    async def health(self) -> dict[str, Any]:
        """Redis as this replica sees it (``{}`` without Redis), and how many sessions it has not saved."""
        unsaved = self.repository.unsaved if self.repository is not None else 0
        return await redis_health(self.engine, unsaved, self.repository.refusal if self.repository else None)

    async def stats(self) -> dict[str, Any]:
        return self.totals()

    def totals(self) -> dict[str, Any]:
        counts = dict(self.repository.counts) if self.repository is not None else {}
        return {**replica_totals(self.engine, self.replica), **counts}

    def routing_stats(self) -> dict[str, Any]:
        """What this replica tells the router (``app.placement``): its room for new sessions, and the
        sessions it let go lately (it no longer holds them, though Ray still lists them as its own)."""
        return routing_stats(replica_room(self.engine, self.residency.max_sessions), list(self.released))

    # --- turns ---------------------------------------------------------------------------------
    async def chat(
        self,
        sid: str,
        token: str | None,
        content: str,
        sampling: dict[str, Any] | None = None,
        history: list[list[str]] | None = None,
        owner: str | None = None,
        turn_key: str | None = None,
    ) -> AsyncIterator[TurnEvent]:
        """Stream one turn: ``TurnStarted`` (the turn was accepted, and where), ``Delta``s, then
        ``Done``; or a single ``TurnFailed`` when the turn cannot start (``app.session_turns``).

        ``history``, when given, is the [role, content] list the caller believes the session
        holds; a different history ends the call with ``history_mismatch`` before any work.
        ``turn_key`` is the turn's idempotency key: a turn already finished under it is answered
        from what the session kept, and does not run again.
        """
        self.start()
        turn = self.turns.run(sid, token, content, sampling, history, owner, turn_key)
        async with contextlib.aclosing(turn) as events:  # a caller that leaves closes the turn now
            async for event in events:
                yield event
