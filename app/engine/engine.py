"""The chat engine: sessions that keep their KV cache between turns (no Ray, no HTTP).

``Engine.chat`` is the contract the serving layer builds on: an async iterator that yields
``TextDelta`` events as text becomes final and ends with exactly one ``TurnDone``. Errors in the
request raise an ``EngineError`` before anything is yielded and leave the session unchanged.
Closing the iterator early (or ``Engine.cancel``) ends the turn as ``cancelled``; the partial
reply is kept in the history, marked ``cancelled``. A turn stopped between two chunks of its
prefill (a cancel, a closed iterator, a device-memory refusal) is undone instead: the session is
as it was before it (a cancel still ends with a ``cancelled`` ``TurnDone``).

All model work runs on one model thread (``Batcher``): the decode steps of every session generating
at the same time are one batched forward, and a new turn's prefill joins that forward. Device
memory is accounted per engine (``DeviceMemory``): a turn is admitted only if its bound fits in
``device_budget_bytes`` with what the other sessions hold, after parking idle sessions if needed;
while turns in flight hold the room it needs it waits for them (``AdmissionQueue``), and otherwise
it is refused with ``device_memory_exhausted`` and the session is unchanged. A turn that may demote
pages to the host tier holds room there first (``HostMemory``): a host tier that is full with nothing
able to spill refuses it with ``host_memory_exhausted``, the session unchanged.

The jobs live in their own modules, as mixins of this class: running a turn
(``app.engine.turns``), rebuilding a lost cache (``app.engine.replay``) and keeping caches on the
device within the budget (``app.engine.residency``). This module holds the sessions and what the
engine offers its callers. Who may use a session is not the engine's business: its callers check (``app.session_access``).
The engine writes a session's KV to Redis when asked (``persist``) and hands back what it wrote;
the session record that carries it is the service's (``app.session_repository``).
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType

from app.contract.ids import new_session_id
from app.engine.admission import AdmissionQueue
from app.engine.batcher import Batcher
from app.engine.chat_format import ChatFormat
from app.engine.errors import InvalidRequest, SessionBusy, SessionNotFound, UnknownMode
from app.engine.events import MemoryStats
from app.engine.host_memory import HostMemory
from app.engine.memory import DeviceMemory
from app.engine.model_runner import ModelRunner
from app.engine.renewal import PendingRenewal
from app.engine.replay import CacheRebuild
from app.engine.residency import DeviceResidency
from app.engine.sampling_defaults import model_generation, served_defaults
from app.engine.session import Session
from app.engine.turns import TurnLoop
from app.model_loader import LoadedModel, load_model
from app.settings import Settings
from rocketkv_mt.cache import CACHE_MODES, SessionCache, TierContext, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.codec import make_codec, page_nbytes
from tiers.host.tier import HostTier
from tiers.session_kv import SessionKV
from tiers.store.redis.client import RedisClient
from tiers.store.redis.config import EvictingRedis, StoreConfig, read_config
from tiers.store.redis.pages import RedisPageStore
from tiers.transfers import Transfers

log = logging.getLogger(__name__)


class Engine(TurnLoop, CacheRebuild, DeviceResidency):
    def __init__(self, settings: Settings, loaded: LoadedModel | None = None):
        """``settings.redis_url`` set: the tiers spill to Redis (a ``tiers.store.protocol.PageStore``)
        through this process's one ``RedisClient`` (``self.redis.client``), which the session records
        share. A Redis that may evict keys is refused here (``EvictingRedis``) unless allowed."""
        self.settings = settings
        self.loaded = loaded or load_model(settings)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded, kernels=settings.kernels)
        self.chat_format = ChatFormat(self.tokenizer, extra_eos=self.runner.eos_ids)
        # What a served turn samples with where its request is silent (the service fills it in).
        self.sampling_defaults = served_defaults(
            settings, model_generation(getattr(self.loaded.model, "generation_config", None)))
        self.max_context = min(settings.max_context or self.runner.max_positions, self.runner.max_positions)
        self._sessions: dict[str, Session] = {}  # changed only by create_session, adopt, drop, delete_session
        self.redis = (
            RedisPageStore(RedisClient(settings.redis_url, settings.redis_timeout_s, settings.redis_retry_s),
                           settings.redis_namespace, settings.redis_pending_ttl_s)
            if settings.redis_url
            else None
        )
        self.store_config = StoreConfig()
        if self.redis is not None:
            try:
                self.check_store(at_start=True)
            except BaseException:  # refused (or unreachable): its client's loop thread goes with it
                self.redis.close()
                raise
        # Cold pages read while the model computes.
        self.transfers = Transfers(self.runner.device, flush_denormal=settings.flush_denormal)
        self.tier_policy = TierPolicy(
            page_tokens=settings.page_tokens,
            prefill_attention=settings.prefill_attention,
            reselect=settings.reselect,
            candidates=settings.digest_candidates,
            page_grouping=settings.page_grouping,
            sketch_bits=settings.sketch_bits,
            sketch_pool=settings.sketch_pool,
            standin=settings.sketch_standin,
            read_whole=settings.digest_read_whole,
            codec=make_codec("int8" if settings.cold_dtype == "int8" else "raw"),
        )
        spec = self.runner.spec
        page_bytes = page_nbytes(self.tier_policy.codec, settings.page_tokens, spec.head_dim, spec.dtype)
        self.host_tier = HostTier(settings.host_tier_bytes, self.redis, page_bytes=page_bytes)
        self.renewal = PendingRenewal(self.host_tier, settings.redis_pending_ttl_s / 4) if self.redis else None
        self.host_memory = HostMemory(self.host_tier, spec, self.tier_policy)
        self.memory_account = DeviceMemory(settings.device_budget_bytes, self.runner.spec, self.tier_policy,
                                           layered=self.runner.layerable)
        self.parking = True  # make room for a turn by parking idle sessions (else refuse it)
        self.rebuilds: Counter = Counter()  # caches restored from their record's KV, or rebuilt
        self.admissions = AdmissionQueue()
        # One model thread: the model steps of all sessions run there, batched (app/engine/batcher.py).
        self.batcher = Batcher(
            self.runner, on_step=self._after_step, prefill_chunk=settings.prefill_chunk, threads=settings.threads,
            flush_denormal=settings.flush_denormal,
        )

    def check_store(self, at_start: bool = False) -> str | None:
        """Read what Redis promises (``tiers.store.redis.config``): kept in ``store_config``; why it must
        not hold sessions, or None. At start a refusal raises ``EvictingRedis`` (unless allowed); later
        (Redis answering again, as after a failover) the caller refuses saves instead. Redis not
        answering: nothing learnt (checked again when it answers)."""
        client = self.redis.client
        try:
            self.store_config = client.run(read_config(client.redis, client.cluster))
        except Exception as exc:  # noqa: BLE001 - not reachable now: checked when it answers again
            log.warning("could not read the Redis configuration (%s: %s); checked again once it answers",
                        type(exc).__name__, exc)
            return None
        refusal = None if self.settings.redis_allow_eviction else self.store_config.refusal()
        if refusal is not None and at_start:
            raise EvictingRedis(refusal)
        return refusal

    # --- sessions ----------------------------------------------------------------------------
    @property
    def sessions(self) -> Mapping[str, Session]:
        """The sessions in this engine's memory, read-only: ``adopt``, ``drop`` and ``delete_session`` change them."""
        return MappingProxyType(self._sessions)

    def session_config(self, mode: str | None = None, budget: int | None = None) -> tuple[str, RocketKVConfig]:
        """The mode and RocketKV config a new session gets, after this engine's checks (``UnknownMode``)."""
        mode = mode or self.settings.mode
        if mode not in CACHE_MODES:
            raise UnknownMode(f"unknown mode {mode!r}; available: {', '.join(sorted(CACHE_MODES))}")
        if budget is not None and not (16 <= budget <= self.max_context):
            raise UnknownMode(f"budget must be between 16 and {self.max_context} tokens")
        rocket = RocketKVConfig(
            token_budget=budget or self.settings.token_budget,
            window_size=self.settings.window_size,
            kernel_size=self.settings.kernel_size,
        )
        return mode, rocket

    def create_session(
        self, mode: str | None = None, budget: int | None = None, system: str | None = None
    ) -> Session:
        mode, rocket = self.session_config(mode, budget)
        sid = new_session_id()
        session = Session(id=sid, mode=mode, rocket=rocket, cache=self.new_cache(mode, rocket, sid))
        if system:
            session.messages.append({"role": "system", "content": system})
        return self.adopt(session)

    def adopt(self, session: Session) -> Session:
        """Hold a session made elsewhere (seeded from a history, restored from a record). Without a
        cache, its next turn makes one: from its parked KV record if it has one, else by prefilling
        its token ids."""
        if session.id in self._sessions:
            raise InvalidRequest("session id already in use")
        self._sessions[session.id] = session
        return session

    def drop(self, session_id: str) -> None:
        """Let go of a session in this process only (idle eviction, a stale copy): its device memory
        and its host-tier pages are freed; what its record names in Redis stays, for whoever restores
        it (``delete_session`` deletes that too). The host tier lets go on the model thread, after
        the jobs already queued for the session's cache (a settle, a persist, a park)."""
        self._sessions.pop(session_id, None)
        self.memory_account.forget(session_id)
        self.batcher.submit(lambda: self.host_tier.drop_session(session_id))

    def new_cache(self, mode: str, rocket: RocketKVConfig, session_id: str = "local") -> SessionCache:
        """An empty cache of this engine's model; tiered caches keep cold tokens in this engine's tiers."""
        tiers = TierContext(host=self.host_tier, session_id=session_id, policy=self.tier_policy,
                            transfers=self.transfers)
        return make_cache(mode, self.runner.spec, rocket, tiers=tiers)

    def get_session(self, session_id: str) -> Session:
        """A session this engine holds (one that is elsewhere is brought here by ``adopt``)."""
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return session

    async def delete_session(self, session_id: str) -> None:
        """Delete a session for good (its record's tombstone, which deletes the KV the record names, is the
        caller's): it leaves this engine at once; on the model thread, after the jobs already queued for its
        cache, its host slots and what it wrote that no record names go."""
        if self.get_session(session_id).busy:
            raise SessionBusy("the session is generating; cancel it first")
        await self.purge(session_id)

    async def purge(self, session_id: str) -> None:
        """``delete_session`` of a session whether or not this engine holds it (deleted elsewhere)."""
        session = self._sessions.pop(session_id, None)
        self.memory_account.forget(session_id)

        def let_go() -> None:
            self.host_tier.drop_session(session_id, deleted=True)
            if session is not None and session.cache is not None:
                session.cache.release()

        await self.batcher.run(let_go)

    def distrust_kv(self, session_id: str) -> None:
        """Redis may have lost the session's KV (its record was gone, or older than this copy): the next
        persist checks every page it was believed to hold, and writes again those it still has."""
        self.host_tier.locked(self.host_tier.copies.distrust, session_id)

    async def renew_pending(self) -> int:
        """Renew now what ``renewal`` renews every quarter of the short TTL (tests, and an operator that will
        not wait); off the event loop. The groups renewed."""
        return 0 if self.redis is None else await asyncio.to_thread(self.host_tier.renew_pending)

    async def kv_settled(self, session_id: str, kv: dict | None, committed: bool) -> None:
        """The record that names the KV generation ``kv`` committed (its commit also deleted what the record
        before named and it does not; a record with no KV left that pending) or did not (``kv``'s own
        tables are removed); off the event loop, since it talks to Redis."""
        session = self._sessions.get(session_id)
        if committed and session is not None:
            session.stored_kv = kv
        if self.redis is None or (kv is None and not committed):
            return
        store = SessionKV(self.host_tier, session_id)
        try:
            await asyncio.to_thread(store.committed if committed else store.abandoned, kv)
        except Exception:  # noqa: BLE001 - the record settled already; what is not collected now expires
            log.warning("session %s: could not collect its KV generations", session_id, exc_info=True)

    def cancel(self, session_id: str) -> bool:
        """Ask a generating session to stop after the current step; False if it was idle."""
        session = self.get_session(session_id)
        if session.busy:
            session.cancel_requested = True
        return session.busy

    async def persist(self, session_id: str) -> dict | None:
        """Write the session's KV to Redis where its mode keeps it there (new cold pages first, then
        page tables and the primary set) and return the cache's record of what it wrote, which the
        session record carries so that any process can restore the cache (as ``Session.parked_kv``).
        None without Redis, for modes that keep no KV there, or when the writes failed: a restore
        then re-prefills the history."""
        session = self._sessions.get(session_id)
        if session is None or self.redis is None:
            return None
        return await self._step(lambda: self._persist_job(session), after=session.cache)

    def stats(self) -> dict:
        """Device memory (budget, held, peak, parks, refusals) and batching figures of this engine."""
        self.memory_account.observe(list(self._sessions))
        batching = {f"batch_{k}": v for k, v in self.batcher.stats.as_dict().items()}
        caches = {f"caches_{k}": self.rebuilds[k] for k in ("kv_restored", "kv_restore_failed", "replayed", "reprefilled")}
        return {**self.memory_account.stats(), **self.host_memory.stats(), **batching, **caches}

    def memory(self, session: Session) -> MemoryStats:
        cache = session.cache
        tiers = cache.tier_bytes() if cache else {"device": 0, "host": 0, "redis": 0}
        return MemoryStats(
            device_bytes=tiers["device"],
            host_bytes=tiers["host"],
            redis_bytes=tiers["redis"],
            readmitted_tokens=session.turns[-1].readmitted_tokens if session.turns else 0,
            history_tokens=len(session.token_ids),
            device_tokens=cache.kept_tokens() if cache else 0,
            **(cache.traffic.as_dict() if cache else {}),
        )

    def close(self) -> None:
        if self.renewal is not None:
            self.renewal.close()
        self.batcher.close()
        self.transfers.close()
        if self.redis is not None:
            self.redis.close()

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "Engine":
        return cls(settings or Settings())
