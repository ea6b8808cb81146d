"""A replica's sessions in Redis: one fenced record per session (``app.session_store``), its saves, loads
and the judgment of what a stored record means for the copy held here (``app.session_fence``).

A session is saved after creation and after every turn, before the turn's ``done`` leaves, which says
what the save gave (``Saved``: not saved, in Redis's memory, fsynced, or replicated). A save is two steps
in this order: the engine writes a new KV generation (``Engine.persist``) and hands back its reference;
the record naming it is then written once by the commit script: the one commit point. Committed, the
KV the record named before and no longer does is gone with it; not committed, the generation's tables
are removed and its pages stay pending while this copy holds them. When the KV's writes failed but the
record's went through, the record holds the history without KV and the session is saved again, with
its KV, once Redis takes it.

Each copy holds the tag it last committed or loaded (its head) and its lineage. A save that finds
another tag is judged: moved on (another replica saved since: this copy stops serving, its turn is not
acknowledged), behind or missing (the store lost this copy's saves and nobody went on: the copy saves it
back, by compare-and-set on what stands, and the loss is logged and counted), or diverged (another
replica acknowledged turns on the older state: this copy stops serving and the loss is reported to the
session's next caller, never silently merged). While Redis is unreachable turns go on in memory, saved
again by housekeeping (``unsaved``), unless the operator chose to refuse them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from app.contract.errors import StoreUnavailable
from app.contract.events import NOT_SAVED, Saved
from app.engine.engine import Engine
from app.engine.session import Session
from app.session_fence import BEHIND, DELETED, DIVERGED, MINE, MISSING, MOVED_ON, judge, lost_saves
from app.session_restore import record, restore, summary
from app.session_store import KV_MISSING, LINEAGE, MOVED, SAVED, SessionStore, Stored, new_tag

log = logging.getLogger(__name__)
STATS_TTL_S = 20
SAVE_ROUNDS = 3  # commits a save tries: a store found behind, or KV found gone, is each one more
DEFERRED = "deferred"  # a turn started meanwhile: its own save writes this state too


def kv_groups(kv: dict | None) -> dict[str, int] | None:
    groups = kv.get("groups") if isinstance(kv, dict) else None
    return groups if isinstance(groups, dict) else None


class SessionRepository:
    def __init__(self, engine: Engine, store: SessionStore, replica: str, stats: Callable[[], dict[str, Any]]):
        self.engine = engine
        self.store = store
        self.replica = replica
        self.stats = stats  # this replica's totals, pushed with every save for /metrics and /v1/stats
        self._head: dict[str, str | None] = {}  # the tag each local session last committed or loaded
        self._lineage: dict[str, list[str]] = {}  # ... and the tags before it, the head last
        self._base: dict[str, str | None] = {}  # what its next commit expects to find (the head, but after a loss)
        self._unsaved: set[str] = set()  # sessions whose latest state Redis does not have
        # Sessions whose record holds their latest history but no KV (the persist failed, Redis failing
        # while the record's own write went through): saved again, with the KV, until Redis takes it.
        self._kv_missing: set[str] = set()
        self._save_locks: dict[str, asyncio.Lock] = {}  # one save of a session at a time
        self.deleted: set[str] = set()  # local sessions found deleted elsewhere: purge, never serve
        self.stale: set[str] = set()  # local copies that must not serve again (moved on, or diverged)
        self.divergences: dict[str, int] = {}  # sessions whose next caller learns the saves the store lost
        self.counts: Counter = Counter()  # saves by durability, and what the store was found to have lost
        self.refusal: str | None = None  # why Redis must not take saves now (an evicting policy), or None
        self._attempted: dict[str, tuple[str, dict | None]] = {}  # a commit whose reply was lost: its tag, its KV

    @property
    def unsaved(self) -> int:
        return len(self._unsaved)

    def track(self, sid: str, stored: Stored | None = None) -> None:
        """Follow a session made here (no record yet) or loaded from ``stored``."""
        tag = stored.tag if stored is not None else None
        self._head[sid] = self._base[sid] = tag
        self._lineage[sid] = list(stored.lineage) if stored is not None else []
        self.stale.discard(sid)

    def forget(self, sid: str) -> None:
        for table in (self._head, self._lineage, self._base, self._save_locks, self._attempted):
            table.pop(sid, None)
        for group in (self._unsaved, self._kv_missing, self.deleted, self.stale):
            group.discard(sid)

    def stored(self, sid: str) -> bool:
        """Redis has this session's latest state (so it may leave memory); never a copy that must not serve."""
        return (self._head.get(sid) is not None and self._base.get(sid) == self._head.get(sid)
                and self._judged(sid) is None and sid not in self._unsaved and sid not in self._kv_missing)

    def can_save(self, sid: str) -> bool:
        """Whether a save of the session could go out now (Redis not known down, nor refused)."""
        return self.refusal is None and not self.store.client.unavailable(self.store.key(sid))

    async def save(self, session: Session, digest: str, retry: bool = False,
                   tells: bool = False) -> tuple[str | None, Saved]:
        """Write the session's KV, then its record: (``SAVED``, what it promises); (``MOVED``,
        ``DELETED`` or ``DIVERGED``, not saved) when this copy must not serve again; (``DEFERRED``, not
        saved) when a turn started meanwhile (its end saves this state too); (None, not saved) when
        Redis did not take it (unreachable, full or refused: kept in ``unsaved``, saved again later).
        ``retry``: saved again by housekeeping, only as far as Redis still lacks it. ``tells``: the caller
        tells its client what this returns (a divergence is then not kept for the session's next caller)."""
        if session.busy:
            return DEFERRED, NOT_SAVED
        async with self._save_locks.setdefault(session.id, asyncio.Lock()):
            if session.busy:
                return DEFERRED, NOT_SAVED  # a turn started while this waited for the lock
            sid = session.id
            kv_only = retry and sid not in self._unsaved
            if kv_only and sid not in self._kv_missing:
                return DEFERRED, NOT_SAVED  # saved meanwhile
            if sid in self.deleted or sid in self.stale:
                self._unsaved.discard(sid)  # a stale copy has nothing Redis should take
                return self._not_mine(sid), NOT_SAVED
            if self.refusal is not None or not await self._resolved(sid):
                self._unsaved.add(sid)
                return None, NOT_SAVED
            mark, parked = session.turns_begun, session.parked_kv
            if session.busy:  # a turn began while Redis was asked about an earlier commit
                return await self._stepped_back(session, None, parked)
            kv = await self.engine.persist(sid)
            if session.turns_begun != mark:
                # A turn began (or ran) while the KV was written: a record now would hold it half-way (its
                # message without its reply); its own end saves the session (housekeeping, if it is undone).
                return await self._stepped_back(session, kv, parked)
            if kv is None and kv_only and session.kv_unwritten:
                return DEFERRED, NOT_SAVED  # Redis still takes no KV: the record as it is holds this history
            return await self._commit(session, digest, kv, retry, tells, mark, parked)

    def _not_mine(self, sid: str) -> str:
        """Why a copy that must not serve again does not: deleted, diverged, or moved on."""
        return DELETED if sid in self.deleted else DIVERGED if sid in self.divergences else MOVED

    async def _commit(self, session: Session, digest: str, kv: dict | None, retry: bool,
                      tells: bool, mark: int, parked: dict | None) -> tuple[str | None, Saved]:
        """Commit the session as it stands (``mark``: the turns it had begun when ``kv`` was written; no await
        between that check and ``record``; ``parked``: the generation it was parked with)."""
        sid = session.id
        lineage = self._lineage.setdefault(sid, [])
        verdict, result = None, None
        for rounds_left in reversed(range(SAVE_ROUNDS)):
            tag = new_tag()
            data = record(session, digest, kv)
            try:
                result = await self.store.save(data, summary(session, self.replica), self._base.get(sid), tag,
                                               [*lineage, tag], kv_groups(kv), stored_bytes(data, kv))
            except Exception as exc:  # Redis unreachable, or refusing (full): turns go on in memory
                # The commit may have landed with its reply lost: its KV stays (renewed) until the stored tag
                # says which (``_resolved``); abandoning it now could take the tables a committed record names.
                self._attempted[sid] = (tag, kv)
                self._unsaved.add(sid)
                self.counts["saves_failed"] += 1
                if not retry:
                    log.warning("could not save session %s (%s: %s); kept in memory, retried", sid,
                                type(exc).__name__, exc)
                return None, NOT_SAVED
            if result.outcome == SAVED:
                break
            await self._abandon(session, kv)
            if result.outcome == MOVED:
                verdict = judge(self._head.get(sid), lineage, result.stored)
                if verdict not in (BEHIND, MISSING):
                    break
                self._found_behind(sid, result.stored)
            elif result.outcome != KV_MISSING:
                break
            else:  # KV it names is gone (the store lost it): written again, or, without a cache, let go
                log.warning("session %s: KV group %s is gone from Redis; writing it again", sid, result.missing)
                self._lose_parked(session, kv)
            if not rounds_left:
                break
            self.engine.distrust_kv(sid)
            kv = await self.engine.persist(sid)
            if session.turns_begun != mark:  # a turn began meanwhile (see ``save``)
                return await self._stepped_back(session, kv, parked)
        return await self._settled(session, kv, result, verdict, tag, retry, tells)

    async def _stepped_back(self, session: Session, kv: dict | None, parked: dict | None) -> tuple[str, Saved]:
        """A save a turn overtook: not committed, saved again later (by that turn's end, or housekeeping).
        The generation it wrote goes, unless it is the one the session was parked with (no cache: the
        persist wrote nothing), which the turn may be restoring from now."""
        self._unsaved.add(session.id)
        if kv is not parked:
            await self._abandon(session, kv)
        return DEFERRED, NOT_SAVED

    async def _abandon(self, session: Session, kv: dict | None) -> None:
        """A generation whose commit did not land goes, unless a cache off the device still stands on it."""
        if kv is not None and kv is not session.parked_kv:
            await self.engine.kv_settled(session.id, kv, committed=False)

    def _lose_parked(self, session: Session, kv: dict | None) -> None:
        """A session with no cache whose stored KV is gone: its next turn rebuilds it by replay, and its
        record names no KV meanwhile (``fed`` says what to replay)."""
        if session.cache is None and kv is not None and kv is session.parked_kv:
            session.parked_kv = None
            session.lost_fed = int(kv.get("history_len") or 0)

    async def _resolved(self, sid: str) -> bool:
        """Whether the outcome of an earlier commit whose reply was lost is known now (the stored tag tells):
        landed, it is this copy's head; not, its generation goes. False while Redis cannot say."""
        attempted = self._attempted.get(sid)
        if attempted is None:
            return True
        try:
            stored = await self.store.stored(sid)
        except Exception:  # noqa: BLE001 - still unknown
            return False
        await self._settle_attempted(sid, stored)
        return True

    async def _settle_attempted(self, sid: str, stored: Stored) -> None:
        """The commit whose reply was lost landed where the stored record is it or descends from it (another
        replica may have gone on from it, naming its KV): its generation is committed, else it goes."""
        tag, kv = self._attempted.pop(sid)
        landed = stored.tag == tag or tag in stored.lineage
        if landed:  # before the await: a save starting meanwhile must build on it
            self._committed(sid, tag)
        await self.engine.kv_settled(sid, kv, committed=landed)

    async def _settled(self, session: Session, kv: dict | None, result, verdict: str | None, tag: str,
                       retry: bool, tells: bool) -> tuple[str | None, Saved]:
        sid = session.id
        outcome = result.outcome if result is not None else None
        if outcome != SAVED:
            self._unsaved.discard(sid)
            if outcome == DELETED:
                log.warning("session %s was deleted elsewhere; dropping the local copy", sid)
                self.deleted.add(sid)
                return DELETED, NOT_SAVED
            if outcome == MOVED and verdict == DIVERGED:
                self._diverged(sid, result.stored, tell_later=not tells)
                return DIVERGED, NOT_SAVED
            if outcome == MOVED and verdict == MOVED_ON:
                log.warning("session %s moved on elsewhere; dropping the local copy", sid)
                self.stale.add(sid)
                return MOVED, NOT_SAVED
            self._unsaved.add(sid)  # rounds spent (the store keeps losing what this writes): tried again later
            return None, NOT_SAVED
        await self.engine.kv_settled(sid, kv, committed=True)
        self._committed(sid, tag)
        self._unsaved.discard(sid)
        self._kv_missing.discard(sid)
        if session.kv_unwritten:
            self._kv_missing.add(sid)
        self.counts[f"saves_{result.saved.durability}"] += 1
        if retry:
            log.info("session %s saved again after a store outage", sid)
        with contextlib.suppress(Exception):  # fresh totals for /metrics; housekeeping pushes them anyway
            await self.push_stats()
        return SAVED, result.saved

    def _committed(self, sid: str, tag: str) -> None:
        """This copy's commit of ``tag`` stands: its head and base, the last of its lineage."""
        self._head[sid] = self._base[sid] = tag
        self._lineage[sid] = [*self._lineage.get(sid, []), tag][-LINEAGE:]

    def _found_behind(self, sid: str, stored: Stored) -> None:
        """The store lost saves of this copy and nobody went on (or it lost the record): this copy is the
        truth, saved back by compare-and-set on what stands; what Redis was believed to hold of its KV is
        checked again."""
        lost = lost_saves(self._lineage.get(sid, []), stored) if stored.tag else len(self._lineage.get(sid, []))
        log.warning("session %s: Redis lost %d save(s) of it that this replica holds (%s); saving it back",
                    sid, lost, "its record is gone" if stored.tag is None else f"it stands at {stored.tag}")
        self.counts["store_losses"] += 1
        self._base[sid] = stored.tag
        self.engine.distrust_kv(sid)

    def _diverged(self, sid: str, stored: Stored, tell_later: bool = True) -> None:
        lost = lost_saves(self._lineage.get(sid, []), stored)
        log.error("session %s: Redis lost %d save(s) this replica acknowledged, and another replica went on "
                  "from the older state; this copy stops serving (the loss is reported to %s)", sid, lost,
                  "the session's next caller here" if tell_later else "the turn's caller")
        self.counts["divergences"] += 1
        self.stale.add(sid)
        if tell_later:
            self.divergences[sid] = lost

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

    async def check(self, sid: str) -> str:
        """How the copy held here stands against its record (``app.session_fence``), acted on: a copy the
        store is behind is saved back at its next save; one that moved on or diverged is marked stale.
        Redis unreachable: ``MINE`` (the local copy is the best there is)."""
        if (judged := self._judged(sid)) is not None:
            return judged  # never served again, whether or not Redis answers now
        if self._saving(sid):
            # A save in flight: Redis may already hold its tag, not another replica's, and its outcome
            # tells whether this copy moved on (waiting for it could wait on the caller's own request).
            return MINE
        try:
            stored = await self.store.stored(sid)
        except Exception:  # Redis unreachable: the local copy is the best there is
            log.warning("session store unreachable; using the local copy of %s", sid)
            return MINE
        return await self._act(sid, stored)

    def _judged(self, sid: str) -> str | None:
        """The verdict on a copy already found not to be the session's (said once, counted once), or None."""
        if sid in self.deleted:
            return DELETED
        if sid in self.stale:
            return DIVERGED if sid in self.divergences else MOVED_ON
        return None

    async def _act(self, sid: str, stored: Stored) -> str:
        if (judged := self._judged(sid)) is not None:
            return judged
        if sid in self._attempted:  # a commit whose reply was lost: the record says whether it landed
            await self._settle_attempted(sid, stored)
        verdict = judge(self._head.get(sid), self._lineage.get(sid, []), stored)
        if verdict == DELETED:
            self.deleted.add(sid)
        elif verdict in (BEHIND, MISSING) and self._base.get(sid) != stored.tag:
            self._found_behind(sid, stored)
            self._unsaved.add(sid)
        elif verdict == MOVED_ON:
            log.info("local copy of session %s is stale (Redis holds %s); restoring", sid, stored.tag)
            self.stale.add(sid)
        elif verdict == DIVERGED:
            self._diverged(sid, stored)
        return verdict

    async def refresh(self) -> tuple[list[str], list[str]]:
        """Judge every session held here against its record (one pipelined read): (those that must not
        serve again, those deleted). Housekeeping drops both, so that a stale copy is gone before Redis
        might become unreachable and it would be the best there is; a copy the store is behind is saved
        back by housekeeping's next round."""
        local = {sid: tag for sid, tag in self._head.items() if tag is not None or sid in self._attempted}
        try:
            found = await self.store.stored_many(list(local))
        except Exception:  # Redis unreachable: nothing learnt
            return [], []
        stale, deleted = [], []
        for sid, stored in zip(local, found):
            if isinstance(stored, BaseException) or self._saving(sid) or self._head.get(sid, "") != local[sid]:
                continue  # its shard does not answer; or saved meanwhile, or a save in flight
            verdict = await self._act(sid, stored)
            if verdict == DELETED:
                deleted.append(sid)
            elif verdict in (MOVED_ON, DIVERGED):
                stale.append(sid)
        return stale, deleted

    def _saving(self, sid: str) -> bool:
        lock = self._save_locks.get(sid)
        return lock is not None and lock.locked()

    async def load(self, sid: str) -> tuple[dict[str, Any], Stored] | None:
        """The stored record and its tag; ``store_unavailable`` when Redis cannot be read."""
        try:
            return await self.store.load(sid)
        except Exception as exc:
            log.warning("cannot restore %s: session store unreachable (%s)", sid, exc)
            raise StoreUnavailable("the session is not on this replica and Redis is unreachable") from None

    async def revive(self, sid: str, data: dict[str, Any], stored: Stored) -> Session:
        """Hold the session of a loaded record in the engine (its KV comes back at its next turn)."""
        session = restore(self.engine, data)
        self.track(sid, stored)
        log.info("restored session %s (%s, %d tokens, %s) on %s", sid, stored.tag, len(session.token_ids),
                 "with its KV" if data.get("kv") else "history only", self.replica)
        return session

    async def delete(self, sid: str, owner: str | None) -> Saved:
        """Leave the session's tombstone (deleting the KV its record names) and say how durably;
        ``store_unavailable`` (nothing deleted) when Redis cannot be written."""
        try:
            return await self.store.delete(sid, owner)
        except Exception as exc:
            log.warning("cannot delete %s: session store unreachable (%s)", sid, exc)
            raise StoreUnavailable("Redis is unreachable; the session was not deleted") from None

    async def push_stats(self) -> None:
        await self.store.put_replica_stats(self.replica, self.stats(), ttl_s=STATS_TTL_S)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.store.drop_replica_stats(self.replica)
        await self.store.close()


def stored_bytes(data: dict[str, Any], kv: dict | None) -> int:
    """What a session keeps in Redis, for its owner's quota: its record, and the KV the record names."""
    size = kv.get("bytes", 0) if isinstance(kv, dict) else 0
    return len(str(data.get("messages", ""))) + 8 * len(data.get("token_ids", ())) + int(size or 0)
