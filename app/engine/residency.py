"""Which sessions' caches are on the device: a turn is admitted within the device budget (parking idle
sessions to make room, or refused) once it holds its room in the host tier (``app.engine.host_memory``,
or refused at once), a parked cache's KV goes to Redis where its mode keeps it there,
and a session without a cache gets one back (restored from its stored KV, or empty to re-prefill).

A mixin of ``Engine`` (``app.engine.engine``): it works on the engine's own state, named below, and
its ``_*_job`` methods run on the model thread (``Batcher``), between batched steps.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from app.engine.admission import AdmissionQueue
from app.engine.batcher import Batcher
from app.engine.errors import DeviceMemoryExhausted
from app.engine.host_memory import HostMemory
from app.engine.memory import DeviceMemory
from app.engine.session import Feed, Session
from app.settings import Settings
from rocketkv_mt.cache import SessionCache
from rocketkv_mt.config import RocketKVConfig
from tiers.store.protocol import PageStore
from tiers.session_kv import KVNotWritten

log = logging.getLogger(__name__)


class DeviceResidency:
    # The engine's state this works on (set by ``Engine.__init__``).
    settings: Settings
    _sessions: dict[str, Session]
    memory_account: DeviceMemory
    host_memory: HostMemory  # the host room a turn holds before it runs
    batcher: Batcher
    admissions: AdmissionQueue  # turns waiting for the device memory that turns in flight hold
    redis: PageStore | None
    parking: bool  # make room for a turn by parking idle sessions (else refuse it)
    new_cache: Callable[[str, RocketKVConfig, str], SessionCache]
    rebuilds: Counter  # caches restored from their record's KV, or found incomplete

    async def _admit_in_turn(self, session: Session, n_new: int, max_new: int, replay: list[Feed] | None = None) -> None:
        """Hold the turn's host room (or refuse it at once), then its device memory (``_admit_device``);
        a device refusal gives the host room back. ``replay``: the turn first rebuilds the session's
        lost cache by replaying these feeds (``app.engine.replay``), and its device memory counts the
        turns it replays. Its host room stays that of one prefill of the whole history into an empty
        cache: the replay ends with the lost cache's cold pages, about what that prefill demotes, where
        adding up the replayed turns' own bounds would count each re-selection's demotions anew, far
        past what the tier ends up holding. A replay that finds the tier full after all stops, undone."""
        self.host_memory.reserve(session, self.memory_account.turn_size(session, n_new, max_new))
        try:
            await self._admit_device(session, n_new, max_new, replay)
        except BaseException:
            self.host_memory.release(session.id)
            raise

    async def _admit_device(self, session: Session, n_new: int, max_new: int, replay: list[Feed] | None = None) -> None:
        """Reserve device memory for a turn, parking idle sessions if needed; while the turns in flight
        hold what it needs, wait for them (in arrival order, up to ``admission_wait_s``); else refuse."""
        shortfall: list[str] = []

        def try_admit() -> bool:
            shortfall[:] = [] if (message := self._reserve(session, n_new, max_new, replay)) is None else [message]
            return not shortfall

        def may_fit_later() -> bool:
            # Another turn in flight will release its reservation; a turn larger than the budget never fits.
            mem = self.memory_account
            return (self.parking and any(sid != session.id for sid in mem.reserved)
                    and mem.turn_bound(session, n_new, max_new, replay=replay) <= mem.budget)

        if not await self.admissions.admit(try_admit, may_fit_later, self.settings.admission_wait_s):
            self.memory_account.refusals += 1
            if not shortfall:  # refused behind the turns already waiting, without a try of its own
                need = self.memory_account.turn_bound(session, n_new, max_new, replay=replay)
                shortfall.append(
                    f"this turn needs up to {need} bytes of device memory of the replica's {self.memory_account.budget}, "
                    f"which it cannot wait for behind the {len(self.admissions)} turns waiting; retry later or send less"
                )
            raise DeviceMemoryExhausted(shortfall[0])

    def _admit(self, session: Session, n_new: int, max_new: int, replay: list[Feed] | None = None) -> None:
        """Hold host room and reserve device memory for a turn now, parking idle sessions if needed, or
        refuse it (holding nothing); ``replay`` as for ``_admit_in_turn``."""
        self.host_memory.reserve(session, self.memory_account.turn_size(session, n_new, max_new))
        message = self._reserve(session, n_new, max_new, replay)
        if message is not None:
            self.host_memory.release(session.id)
            self.memory_account.refusals += 1
            raise DeviceMemoryExhausted(message)

    def _reserve(self, session: Session, n_new: int, max_new: int, replay: list[Feed] | None = None) -> str | None:
        """Reserve device memory for a turn, parking idle sessions if needed; None when reserved, else
        why it does not fit (nothing changed)."""
        mem = self.memory_account
        need = mem.turn_bound(session, n_new, max_new, replay=replay)
        # What a chunked prefill holds beyond that until its last chunk (only the largest is committed:
        # the batcher feeds one prefill in chunks at a time).
        chunk = self.settings.prefill_chunk
        extra = max(0, mem.turn_bound(session, n_new, max_new, prefill_chunk=chunk, replay=replay) - need)
        if mem.budget:
            committed = mem.committed(self._sessions, exclude=session.id, chunking=extra)
            victims: list[Session] = []
            if committed + need > mem.budget and self.parking:
                idle = sorted(
                    (s for s in self._sessions.values()
                     if s is not session and not s.busy and s.cache is not None and mem.held.get(s.id, 0) > 0),
                    key=lambda s: s.last_used,
                )
                freed = 0
                for victim in idle:
                    if committed - freed + need <= mem.budget:
                        break
                    victims.append(victim)
                    freed += mem.held.get(victim.id, 0)
                committed -= freed
            if committed + need > mem.budget:
                return (
                    f"this turn needs up to {need} bytes of device memory and {committed} of the replica's "
                    f"{mem.budget} are held by sessions that cannot be parked now; retry later or send less"
                )
            for victim in victims:
                self._park(victim)
        mem.reserved[session.id], mem.chunking[session.id] = need, extra
        return None

    def _park(self, session: Session) -> None:
        """Take an idle session's cache off the device; its next turn restores it (or re-prefills)."""
        cache = self.memory_account.take_cache(session)
        session.parked_kv = None
        session.parked = True
        self.memory_account.parks += 1
        self.batcher.submit(lambda: self._park_job(session, cache), after=cache)

    def _park_job(self, session: Session, cache: SessionCache) -> None:
        """Model thread: write the parked cache's KV to Redis where its mode can; else free its tiers. A
        write that failed (Redis down) leaves its next turn to rebuild the very same cache by replay."""
        state, fed = None, 0
        try:
            state = cache.persist() if self.redis is not None else None
        except Exception:  # noqa: BLE001 - parking falls back to a rebuild
            log.warning("session %s: could not persist its KV for parking", session.id, exc_info=True)
            fed = cache.history_len
        if state is None:
            cache.release()
        if session.cache is None:
            session.parked_kv = state
            session.lost_fed = session.lost_fed or fed
        log.info("parked session %s (%s)", session.id, "KV in Redis" if state else "re-prefill at its next turn")

    def _persist_job(self, session: Session) -> dict | None:
        """Model thread: write the session's KV to Redis and return the cache's record of it, or the
        record it was parked or restored with while it has no cache; None when there is nothing to
        restore from (a mode that keeps no KV in Redis, Redis down, or a failure, logged here)."""
        cache = session.cache
        session.kv_unwritten = False
        if cache is None:
            return session.parked_kv
        try:
            return cache.persist()
        except KVNotWritten as exc:  # Redis failing: the record goes without KV, saved again with it later
            log.warning("session %s: could not persist its KV (%s)", session.id, exc)
            session.kv_unwritten = True
            return None
        except Exception:  # noqa: BLE001 - the record then goes without KV: a restore re-prefills
            log.warning("session %s: could not persist its KV", session.id, exc_info=True)
            self._drop_if_broken(session, cache)
            # Dropped half-updated: the record keeps naming what Redis holds of it, if anything.
            return session.parked_kv if session.cache is None else None

    def _drop_if_broken(self, session: Session, cache: SessionCache) -> None:
        """Model thread, after a job on a session's cache failed: a cache the failure left half-updated
        (``SessionCache.broken``; also one whose later prefill was taken back half way) goes, so that no
        turn runs on it. Its next turn restores it from the generation its record names (``stored_kv``)
        where that is this very cache's state, or else rebuilds it by replaying what it had been fed (an
        older generation and one prefill of the turns since would give another cache, and other replies).
        One that failed with nothing changed stays."""
        if not cache.broken or session.cache is not cache:
            return
        log.warning("session %s: a failed change left its cache half-updated; dropped, its next turn "
                    "restores or rebuilds it", session.id)
        fed = cache.history_len
        self.memory_account.take_cache(session)
        self._release_quietly(session, cache)
        stored = session.stored_kv
        if stored is not None and stored.get("history_len") == fed:
            session.parked_kv = stored
        elif fed:
            session.lost_fed = fed

    def _release_quietly(self, session: Session, cache: SessionCache) -> None:
        """Model thread: free a dropped cache's tier chunks now rather than at the session's deletion.

        A failure here is logged, not raised: it must neither mask a failed turn's own error nor
        stop a rebuild."""
        try:
            cache.release()
        except Exception:  # noqa: BLE001 - see above
            log.warning("session %s: could not free a dropped cache", session.id, exc_info=True)

    def _materialize(self, session: Session) -> None:
        """Model thread: give a session without a cache one, restored from its parked record if any."""
        if session.cache is not None:
            return
        cache = self.new_cache(session.mode, session.rocket, session.id)
        state, session.parked_kv = session.parked_kv, None
        restored = state is not None and cache.restore(state)
        if state is not None:
            self.rebuilds["kv_restored" if restored else "kv_restore_failed"] += 1
        if state is not None and not restored:
            # Pages it names are gone (Redis lost them, or is down): the cache is lost as one whose pages
            # went missing mid-turn is, and its turn rebuilds it (``app.engine.replay``).
            log.warning("session %s: stored KV incomplete; its cache will be rebuilt", session.id)
            cache = self.new_cache(session.mode, session.rocket, session.id)
            fed = state.get("history_len")
            session.lost_fed = fed if isinstance(fed, int) and fed > 0 else 0
        session.cache = cache
        session.parked = False
        self.memory_account.set_held(session.id, cache.device_bytes())

    def _rebuild_cache(self, session: Session) -> SessionCache:
        """Model thread: replace a session's (half-updated) cache by an empty one to re-prefill into."""
        dropped, session.cache = session.cache, None
        if dropped is not None:
            self._release_quietly(session, dropped)
        self._materialize(session)
        return session.cache

    def _after_step(self, session_ids: list[str]) -> None:
        """Model thread, after every batched step: measure the caches that changed, and the total."""
        mem = self.memory_account
        for sid in session_ids:
            session = self._sessions.get(sid)
            if session is not None:
                mem.measure(session)
        mem.observe(list(self._sessions))

