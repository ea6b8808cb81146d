"""A replica's sessions in Redis: compare-and-set saves of each session's record, and loads.

With a ``SessionStore``, a session is saved after creation and after every turn, before the
turn's ``done`` leaves, so whoever sees ``done`` can rely on another replica restoring that state.
Each save names the version it read (``versions``): a replica holding a stale copy (another one took
the session over meanwhile) fails its save and learns that its copy must not serve again. While
Redis is unreachable turns go on in memory; the sessions whose save failed (``unsaved``) are
saved again by the service's housekeeping until Redis takes them.

A restore prefers the engine's own stored copy when it is the same conversation as the record: it
brings a tiered session's KV back without re-prefilling; a copy that differs (a replica died
between the two writes) or whose KV keys are gone is ignored in favour of the record, which the
client's last ``done`` vouches for.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from app.contract.errors import StoreUnavailable
from app.engine.engine import Engine
from app.engine.session import Session
from app.session_restore import record, restore, summary
from app.session_store import SessionStore

log = logging.getLogger(__name__)
STATS_TTL_S = 20


class SessionRepository:
    def __init__(self, engine: Engine, store: SessionStore, replica: str, stats: Callable[[], dict[str, Any]]):
        self.engine = engine
        self.store = store
        self.replica = replica
        self.stats = stats  # this replica's totals, pushed with every save for /metrics and /v1/stats
        # Store version each local session was last saved or loaded at; None = never saved, -1 = stale.
        self._versions: dict[str, int | None] = {}
        self._unsaved: set[str] = set()  # sessions whose latest state Redis does not have
        self._save_lock = asyncio.Lock()

    @property
    def unsaved(self) -> int:
        return len(self._unsaved)

    def track(self, sid: str, version: int | None = None) -> None:
        """Follow a session made here (``None``: not saved yet) or loaded at ``version``."""
        self._versions[sid] = version

    def forget(self, sid: str) -> None:
        self._versions.pop(sid, None)
        self._unsaved.discard(sid)

    def stored(self, sid: str) -> bool:
        """Redis has this session's latest state (so it may leave memory)."""
        return bool(self._versions.get(sid)) and sid not in self._unsaved

    async def save(self, session: Session, digest: str, quiet: bool = False) -> None:
        """Write the session's record as the next version; on failure keep it in ``unsaved``."""
        async with self._save_lock:
            expected = self._versions.get(session.id)
            data, summ = record(session, digest), summary(session, self.replica)
            try:
                ok = await self.store.save(data, summ, expected)
                if not ok and expected is not None and await self.store.version(session.id) is None:
                    # The record is gone (expired, or Redis came back empty): this copy is the truth.
                    expected = None
                    ok = await self.store.save(data, summ, None)
            except Exception as exc:  # Redis unreachable: turns go on in memory
                self._unsaved.add(session.id)
                if not quiet:
                    log.warning("could not save session %s (%s: %s); kept in memory, retried", session.id,
                                type(exc).__name__, exc)
                return
            self._unsaved.discard(session.id)
            if ok:
                self._versions[session.id] = (expected or 0) + 1
                if quiet:
                    log.info("session %s saved again after a store outage", session.id)
                with contextlib.suppress(Exception):  # fresh totals for /metrics; housekeeping pushes them anyway
                    await self.push_stats()
            else:
                # Another replica saved a newer state: this copy must not serve again.
                log.warning("session %s moved on elsewhere; dropping the local copy", session.id)
                self._versions[session.id] = -1

    async def save_unsaved(self, digest_of: Callable[[str], str | None]) -> None:
        for sid in list(self._unsaved):
            session = self.engine.sessions.get(sid)
            digest = digest_of(sid)
            if session is None or digest is None:
                self._unsaved.discard(sid)
            elif not session.busy:  # a busy one is saved at the end of its turn anyway
                await self.save(session, digest, quiet=True)

    async def is_stale(self, session: Session) -> bool:
        """Whether another replica saved a newer state of this session since this copy was saved."""
        try:
            stored = await self.store.version(session.id)
        except Exception:  # Redis unreachable: the local copy is the best there is
            log.warning("session store unreachable; using the local copy of %s", session.id, exc_info=True)
            return False
        local = self._versions.get(session.id)
        if stored is None:
            self._versions[session.id] = None  # expired from the store: the next save recreates it
            return False
        if local is None or stored > local:
            log.info("local copy of session %s is stale (v%s < v%s); restoring", session.id, local, stored)
            return True
        return False

    async def load(self, sid: str) -> tuple[dict[str, Any], int] | None:
        """The stored record and its version; ``store_unavailable`` when Redis cannot be read."""
        try:
            return await self.store.load(sid)
        except Exception as exc:
            log.warning("cannot restore %s: session store unreachable (%s)", sid, exc)
            raise StoreUnavailable("the session is not on this replica and Redis is unreachable") from None

    async def revive(self, sid: str, data: dict[str, Any], version: int) -> Session:
        """Hold the session of a loaded record in the engine: its own stored copy when it matches."""
        session = await self._engine_copy(sid, data) or restore(self.engine, data)
        session.owner = data.get("owner")
        self.track(sid, version)
        log.info("restored session %s (v%d, %d tokens) on %s", sid, version, len(session.token_ids), self.replica)
        return session

    async def _engine_copy(self, sid: str, data: dict[str, Any]) -> Session | None:
        copy = self.engine.stored_copy(sid)
        if not copy or copy.get("token_ids") != data["token_ids"] or len(copy.get("turns", [])) != len(data["turns"]):
            return None
        try:
            complete = await self.store.exists_all(self.engine.stored_kv_keys(sid, copy))
        except Exception:  # an unreadable record, or Redis gone again: do not trust the KV
            complete = False
        if not complete:
            log.warning("session %s: stored KV incomplete (its replica died mid-turn); re-prefilling", sid)
            return None
        return self.engine.restore_stored(sid)

    async def delete(self, sid: str) -> None:
        await self.store.delete(sid)

    async def push_stats(self) -> None:
        await self.store.put_replica_stats(self.replica, self.stats(), ttl_s=STATS_TTL_S)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.store.drop_replica_stats(self.replica)
        await self.store.close()
