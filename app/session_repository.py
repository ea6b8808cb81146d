"""A replica's sessions in Redis: one compare-and-set record per session, its saves and loads.

With a ``SessionStore``, a session is saved after creation and after every turn, before the
turn's ``done`` leaves, so whoever sees ``done`` can rely on another replica restoring that state.
A save is two steps in this order: the engine writes a new KV generation (``Engine.persist``: pages,
then page tables and primary set, ``tiers.session_kv``) and hands back its reference; the record,
naming it in its ``kv``, is then written once by compare-and-set: the one commit point. Committed,
the generations before it are collected; not committed (another version, a tombstone, or Redis
failing), the generation is removed. A record thus names exactly one generation, written whole
before it, or none: when the KV's writes failed but the record's went through, the record holds the
history without KV (superseding the generation named before it) and the session is saved again, with
its KV, once Redis takes it.

Each save names the version it read (``versions``): a replica holding a stale copy (another one took
the session over meanwhile) fails its save and learns that its copy must not serve again; a save that
finds the session's tombstone learns it was deleted. While Redis is unreachable turns go on in
memory; the sessions whose save failed (``unsaved``) are saved again by the service's housekeeping
until Redis takes them.

A restore reads the record alone: the engine restores the cache from the generation its ``kv`` names
at the session's next turn, all or nothing, and re-prefills the history otherwise.
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
from app.session_store import DELETED, MOVED, SAVED, TOMBSTONE, SessionStore
from tiers.session_kv import SessionKV

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
        # Sessions whose record holds their latest history but no KV (the persist failed, Redis failing
        # while the record's own write went through): saved again, with the KV, until Redis takes it.
        self._kv_missing: set[str] = set()
        self._save_locks: dict[str, asyncio.Lock] = {}  # one save of a session at a time
        self.deleted: set[str] = set()  # local sessions a save found deleted elsewhere: purge, never serve

    @property
    def unsaved(self) -> int:
        return len(self._unsaved)

    def track(self, sid: str, version: int | None = None) -> None:
        """Follow a session made here (``None``: not saved yet) or loaded at ``version``."""
        self._versions[sid] = version

    def forget(self, sid: str) -> None:
        self._versions.pop(sid, None)
        self._save_locks.pop(sid, None)
        self._unsaved.discard(sid)
        self._kv_missing.discard(sid)
        self.deleted.discard(sid)

    def stored(self, sid: str) -> bool:
        """Redis has this session's latest state (so it may leave memory)."""
        return bool(self._versions.get(sid)) and sid not in self._unsaved and sid not in self._kv_missing

    async def save(self, session: Session, digest: str, retry: bool = False) -> str | None:
        """Write the session's KV, then its record as the next version: ``SAVED``; ``MOVED`` or ``DELETED``
        when this copy is stale (it must not serve again); None when nothing was written (Redis
        unreachable: kept in ``unsaved``; or a turn started meanwhile, whose end saves). ``retry``: saved
        again by housekeeping, only as far as Redis still lacks it (a record holding the latest history
        without KV is written again only with its KV)."""
        if session.busy:
            return None  # a turn started meanwhile: its end saves both together
        async with self._save_locks.setdefault(session.id, asyncio.Lock()):
            if session.busy:
                return None  # a turn started while this waited for the lock (its cache may be mid-prefill)
            kv_only = retry and session.id not in self._unsaved
            if kv_only and session.id not in self._kv_missing:
                return None  # saved meanwhile
            expected = self._versions.get(session.id)
            if session.id in self.deleted or expected == -1:
                self._unsaved.discard(session.id)  # a stale copy has nothing Redis should take
                return DELETED if session.id in self.deleted else MOVED  # it must not serve again, nor write
            kv = await self.engine.persist(session.id)
            if kv is None and kv_only and session.kv_unwritten:
                return None  # Redis still takes no KV: the record as it is holds this history
            data, summ = record(session, digest, kv), summary(session, self.replica)
            try:
                outcome = await self.store.save(data, summ, expected)
                if outcome == MOVED and expected is not None and await self.store.version(session.id) is None:
                    # The record expired (or Redis came back empty): this copy is the truth, and what
                    # Redis was believed to hold of its KV is checked, and written again where lost.
                    await self.engine.kv_settled(session.id, kv, committed=False)
                    self.engine.distrust_kv(session.id)
                    kv = await self.engine.persist(session.id)
                    data, expected = record(session, digest, kv), None
                    outcome = await self.store.save(data, summ, None)
            except Exception as exc:  # Redis unreachable: turns go on in memory
                await self.engine.kv_settled(session.id, kv, committed=False)
                self._unsaved.add(session.id)
                if not retry:
                    log.warning("could not save session %s (%s: %s); kept in memory, retried", session.id,
                                type(exc).__name__, exc)
                return None
            await self.engine.kv_settled(session.id, kv, committed=outcome == SAVED)
            self._unsaved.discard(session.id)
            self._kv_missing.discard(session.id)
            if outcome == SAVED:
                self._versions[session.id] = (expected or 0) + 1
                if session.kv_unwritten:
                    self._kv_missing.add(session.id)
                if retry:
                    log.info("session %s saved again after a store outage", session.id)
                with contextlib.suppress(Exception):  # fresh totals for /metrics; housekeeping pushes them anyway
                    await self.push_stats()
            elif outcome == DELETED:
                log.warning("session %s was deleted elsewhere; dropping the local copy", session.id)
                self._versions[session.id] = -1
                if session.id in self.engine.sessions:  # still here: purged at its next request
                    self.deleted.add(session.id)
            else:
                # Another replica saved a newer state: this copy must not serve again.
                log.warning("session %s moved on elsewhere; dropping the local copy", session.id)
                self._versions[session.id] = -1
            return outcome

    async def save_unsaved(self, digest_of: Callable[[str], str | None]) -> None:
        """Save again the sessions Redis lacks the latest state of, or only the KV of."""
        for sid in [*self._unsaved, *(self._kv_missing - self._unsaved)]:
            session = self.engine.sessions.get(sid)
            digest = digest_of(sid)
            if session is None or digest is None:
                self._unsaved.discard(sid)
                self._kv_missing.discard(sid)
            elif not session.busy:  # a busy one is saved at the end of its turn anyway
                await self.save(session, digest, retry=True)

    async def refresh(self) -> tuple[list[str], list[str]]:
        """Compare the sessions held here with their records (one pipelined read): (those another replica
        saved since, those deleted). Housekeeping drops both, so that a stale copy is gone before Redis
        might become unreachable and it would be the best there is."""
        local = {sid: version for sid, version in self._versions.items() if version is not None}
        try:
            stored = await self.store.versions(list(local))
        except Exception:  # Redis unreachable: nothing learnt
            return [], []
        stale, deleted = [], []
        for sid, version in zip(local, stored):
            if isinstance(version, BaseException):  # its shard does not answer: nothing learnt
                continue
            if self._saving(sid) or self._versions.get(sid) != local[sid]:
                continue  # saved meanwhile, or a save in flight (what it reads may be its own version)
            if version == TOMBSTONE:
                deleted.append(sid)
            elif version is not None and version > local[sid]:
                stale.append(sid)
        self.deleted.update(deleted)
        return stale, deleted

    async def keep_alive(self) -> None:
        """Say this process's KV writer lives (``tiers.redis_tier``; what it writes is not swept)."""
        if self.engine.redis is not None:
            await asyncio.to_thread(self.engine.redis.keep_alive)

    async def sweep_dead_writers(self) -> int:
        """Delete what writers that died (a replica killed mid-turn) left of sessions and their records do
        not name, so that no key outlives what a record names; the names deleted."""
        redis = self.engine.redis
        if redis is None:
            return 0
        swept = 0
        for writer, sid in await asyncio.to_thread(redis.dead_writings):
            try:
                loaded = await self.store.load(sid)
            except Exception:  # Redis unreachable: swept later
                return swept
            ref = loaded[0].get("kv") if loaded is not None else None
            swept += await asyncio.to_thread(SessionKV(self.engine.host_tier, sid).sweep_dead_writer, writer, ref) or 0
        if swept:
            log.info("swept %d KV keys that dead writers left unnamed", swept)
        return swept

    async def unfinished_deletes(self, older_than_s: float) -> list[str]:
        try:
            return await self.store.unfinished_deletes(older_than_s)
        except Exception:  # Redis unreachable: finished later
            return []

    async def finished_delete(self, sid: str) -> None:
        with contextlib.suppress(Exception):  # left in the log: finished again later, harmlessly
            await self.store.deleted(sid)

    def _saving(self, sid: str) -> bool:
        lock = self._save_locks.get(sid)
        return lock is not None and lock.locked()

    async def is_stale(self, session: Session) -> bool:
        """Whether another replica saved a newer state of this session since this copy was saved."""
        if self._saving(session.id):
            # A save in flight: Redis may already hold its version, not another replica's, and its outcome
            # tells whether this copy moved on (waiting for it could wait on the caller's own request).
            return False
        try:
            stored = await self.store.version(session.id)
        except Exception:  # Redis unreachable: the local copy is the best there is
            log.warning("session store unreachable; using the local copy of %s", session.id, exc_info=True)
            return False
        local = self._versions.get(session.id)
        if stored == TOMBSTONE:
            self.deleted.add(session.id)
            return True
        if stored is None:
            # Expired from the store, or Redis came back empty: the next save recreates it, checking what
            # Redis was believed to hold of its KV.
            self._versions[session.id] = None
            self.engine.distrust_kv(session.id)
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
        """Hold the session of a loaded record in the engine (its KV comes back at its next turn)."""
        session = restore(self.engine, data)
        self.track(sid, version)
        log.info("restored session %s (v%d, %d tokens, %s) on %s", sid, version, len(session.token_ids),
                 "with its KV" if data.get("kv") else "history only", self.replica)
        return session

    async def delete(self, sid: str) -> None:
        """Leave the session's tombstone; ``store_unavailable`` (nothing deleted) when Redis cannot be written."""
        try:
            await self.store.delete(sid)
        except Exception as exc:
            log.warning("cannot delete %s: session store unreachable (%s)", sid, exc)
            raise StoreUnavailable("Redis is unreachable; the session was not deleted") from None

    async def push_stats(self) -> None:
        await self.store.put_replica_stats(self.replica, self.stats(), ttl_s=STATS_TTL_S)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.store.drop_replica_stats(self.replica)
        await self.store.close()
