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
otherwise it is refused with ``device_memory_exhausted`` and the session is unchanged.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from app.contract.ids import new_session_id
from app.engine.batcher import Batcher
from app.engine.chat_format import ChatFormat
from app.engine.detokenizer import Detokenizer
from app.engine.errors import (
    ContextLengthExceeded,
    DeviceMemoryExhausted,
    EmptyMessage,
    InvalidRequest,
    MaxTokensTooLarge,
    MessageTooLarge,
    SessionBusy,
    SessionNotFound,
    TurnCancelled,
    UnknownMode,
)
from app.engine.events import MemoryStats, TextDelta, TurnDone, Usage
from app.engine.memory import DeviceMemory
from app.engine.model_runner import ModelRunner
from app.engine.persistence import kv_keys, persist_session, restore_session
from app.engine.sampling import SamplingParams, make_generator, sample
from app.engine.session import Session, TurnStats
from app.engine.steps import PrefillGate
from app.model_loader import LoadedModel, load_model
from app.settings import Settings
from rocketkv_mt.cache import CACHE_MODES, SessionCache, TierContext, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.codec import make_codec
from tiers.host import ChunkUnavailable, HostTier
from tiers.redis_tier import RedisTier

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    def __init__(self, settings: Settings, loaded: LoadedModel | None = None):
        self.settings = settings
        self.loaded = loaded or load_model(settings)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded, kernels=settings.kernels)
        self.chat_format = ChatFormat(self.tokenizer, extra_eos=self.runner.eos_ids)
        self.max_context = min(settings.max_context or self.runner.max_positions, self.runner.max_positions)
        self._sessions: dict[str, Session] = {}  # changed only by create_session, adopt, drop, delete_session
        self.redis = (
            RedisTier(settings.redis_url, settings.redis_namespace, settings.redis_ttl_s) if settings.redis_url else None
        )
        self.host_tier = HostTier(settings.host_tier_bytes, self.redis)
        self.memory_account = DeviceMemory(
            settings.device_budget_bytes, self.runner.spec,
            digest_candidates=settings.digest_candidates if settings.reselect == "digest" else None,
            page_tokens=settings.page_tokens,
        )
        self.parking = True  # make room for a turn by parking idle sessions (else refuse it)
        # One model thread: the model steps of all sessions run there, batched (app/engine/batcher.py).
        self.batcher = Batcher(
            self.runner, on_step=self._after_step, prefill_chunk=settings.prefill_chunk, threads=settings.threads
        )

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
        and its host-tier pages are freed; what Redis holds for it stays, for whoever restores it
        (``delete_session`` deletes that too)."""
        self._sessions.pop(session_id, None)
        self.memory_account.forget(session_id)
        self.host_tier.drop_session(session_id)

    def stored_copy(self, session_id: str) -> dict[str, Any] | None:
        """The record this engine's Redis tier keeps for a session (messages, token ids, KV state), if any."""
        return self.redis.get_meta(session_id) if self.redis is not None else None

    def stored_kv_keys(self, session_id: str, record: dict[str, Any]) -> list[str]:
        """The Redis keys a stored record's KV state needs, to check they are all still there."""
        return kv_keys(self.redis, session_id, record) if self.redis is not None else []

    def restore_stored(self, session_id: str) -> Session | None:
        """Hold the session of this engine's stored record (KV loaded at its next turn), if there is one."""
        session = restore_session(self.redis, session_id) if self.redis is not None else None
        return self.adopt(session) if session is not None else None

    def new_cache(self, mode: str, rocket: RocketKVConfig, session_id: str = "local") -> SessionCache:
        """An empty cache of this engine's model; tiered caches keep cold tokens in this engine's tiers."""
        tiers = TierContext(
            host=self.host_tier,
            session_id=session_id,
            page_tokens=self.settings.page_tokens,
            prefill_attention=self.settings.prefill_attention,
            reselect=self.settings.reselect,
            candidates=self.settings.digest_candidates,
            codec=make_codec("int8" if self.settings.cold_dtype == "int8" else "raw"),
        )
        return make_cache(mode, self.runner.spec, rocket, tiers=tiers)

    def get_session(self, session_id: str, owner: str | None = None) -> Session:
        """A session of this engine, or one restored from Redis (another process may have written it).

        Only for its owner: a session filed under another owner is as missing as an unknown id.
        """
        if not isinstance(session_id, str) or not session_id:
            raise SessionNotFound(f"no session {session_id!r}")
        session = self._sessions.get(session_id)
        if session is None and self.redis is not None:
            session = restore_session(self.redis, session_id)
            if session is not None and session.owner == owner:
                self.adopt(session)
        if session is None or session.owner != owner:
            raise SessionNotFound(f"no session {session_id!r}")
        return session

    def delete_session(self, session_id: str, owner: str | None = None) -> None:
        session = self.get_session(session_id, owner)
        if session.busy:
            raise SessionBusy("the session is generating; cancel it first")
        del self._sessions[session_id]
        self.memory_account.forget(session_id)
        if session.cache is not None:
            session.cache.release()
        if self.redis is not None:
            self.redis.delete_session(session_id)

    def cancel(self, session_id: str, owner: str | None = None) -> bool:
        """Ask a generating session to stop after the current step; False if it was idle."""
        session = self.get_session(session_id, owner)
        if session.busy:
            session.cancel_requested = True
        return session.busy

    # --- turns -------------------------------------------------------------------------------
    def _turn_ids(self, session: Session, content: str) -> list[int]:
        user = {"role": "user", "content": content}
        if not any(m["role"] == "assistant" for m in session.messages):
            return self.chat_format.first_turn([*session.messages, user])
        last = session.token_ids[-1] if session.token_ids else None
        closing = "" if session.messages[-1].get("closed") else self.chat_format.closing_after(last)
        return self.chat_format.next_turn(session.messages, user, closing)

    def _validate(self, session: Session, content: str, params: SamplingParams) -> list[int]:
        if session.busy:
            raise SessionBusy("a reply is already being generated in this session")
        if not isinstance(content, str) or not content.strip():
            raise EmptyMessage("the message is empty")
        if len(content.encode("utf-8", "surrogatepass")) > self.settings.max_message_bytes:
            raise MessageTooLarge(f"the message is over {self.settings.max_message_bytes} bytes")
        if params.max_tokens is not None and params.max_tokens > self.settings.max_tokens_limit:
            raise MaxTokensTooLarge(f"max_tokens is over the limit of {self.settings.max_tokens_limit}")
        new_ids = self._turn_ids(session, content)
        total = len(session.token_ids) + len(new_ids)
        if total + 1 > self.max_context:
            raise ContextLengthExceeded(
                f"the conversation would be {total} tokens; the model context is {self.max_context} "
                "(the session is unchanged; start a new one or send less)"
            )
        return new_ids

    async def _step(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model thread, between batched steps; a cancelled caller still waits for it."""
        return await self.batcher.run(fn)

    # --- device memory -----------------------------------------------------------------------
    def _admit(self, session: Session, n_new: int, max_new: int) -> None:
        """Reserve device memory for a turn, parking idle sessions if needed, or refuse it."""
        mem = self.memory_account
        need = mem.turn_bound(session, n_new, max_new)
        extra = mem.turn_bound(session, n_new, max_new, prefill_chunk=self.settings.prefill_chunk) - need
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
                mem.refusals += 1
                raise DeviceMemoryExhausted(
                    f"this turn needs up to {need} bytes of device memory and {committed} of the replica's "
                    f"{mem.budget} are held by sessions that cannot be parked now; retry later or send less"
                )
            for victim in victims:
                self._park(victim)
        mem.reserved[session.id], mem.chunking[session.id] = need, extra

    def _park(self, session: Session) -> None:
        """Take an idle session's cache off the device; its next turn restores it (or re-prefills)."""
        cache, session.cache = session.cache, None
        session.parked_kv = None
        self.memory_account.set_held(session.id, 0)
        self.memory_account.parks += 1
        self.batcher.submit(lambda: self._park_job(session, cache))

    def _park_job(self, session: Session, cache: SessionCache) -> None:
        """Model thread: write the parked cache's KV to Redis where its mode can; else free its tiers."""
        state = None
        try:
            state = cache.persist() if self.redis is not None else None
        except Exception:  # noqa: BLE001 - parking falls back to a re-prefill
            log.warning("session %s: could not persist its KV for parking", session.id, exc_info=True)
        if state is None:
            cache.release()
        if session.cache is None:
            session.parked_kv = state
        log.info("parked session %s (%s)", session.id, "KV in Redis" if state else "re-prefill at its next turn")

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
        if state is not None and not cache.restore(state):
            log.warning("session %s: stored KV incomplete; the history will be re-prefilled", session.id)
            cache = self.new_cache(session.mode, session.rocket, session.id)
        session.cache = cache
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
            if session is not None and session.cache is not None:
                mem.set_held(sid, session.cache.device_bytes())
        mem.observe(list(self._sessions))

    def stats(self) -> dict:
        """Device memory (budget, held, peak, parks, refusals) and batching figures of this engine."""
        self.memory_account.observe(list(self._sessions))
        batching = {f"batch_{k}": v for k, v in self.batcher.stats.as_dict().items()}
        return {**self.memory_account.stats(), **batching}

    async def chat(
        self, session_id: str, content: str, params: SamplingParams | None = None, owner: str | None = None
    ) -> AsyncIterator[TextDelta | TurnDone]:
        """Validate and start a turn; returns the async iterator of its events."""
        session = self.get_session(session_id, owner)
        params = params or SamplingParams()
        new_ids = self._validate(session, content, params)
        prompt_tokens = len(session.token_ids) + len(new_ids)
        max_new = min(params.max_tokens or self.settings.max_new_tokens, self.max_context - prompt_tokens)
        self._admit(session, len(new_ids), max_new)
        session.busy = True
        session.cancel_requested = False
        return self._run_turn(session, content, new_ids, params, max_new)

    async def complete(self, session_id: str, content: str, params: SamplingParams | None = None) -> TurnDone:
        """Run a whole turn and return its ``TurnDone``."""
        done = None
        async for event in await self.chat(session_id, content, params):
            if isinstance(event, TurnDone):
                done = event
        return done

    async def _run_turn(
        self, session: Session, content: str, new_ids: list[int], params: SamplingParams, max_new: int
    ) -> AsyncIterator[TextDelta | TurnDone]:
        t0 = time.perf_counter()
        before = len(session.messages), len(session.token_ids)
        session.messages.append({"role": "user", "content": content})
        session.token_ids.extend(new_ids)
        stats = TurnStats(prompt_tokens=len(session.token_ids), prefilled_tokens=0)
        detok = Detokenizer(self.tokenizer, params.stop)
        generator = make_generator(params, self.runner.device)
        finish = "length"
        generated: list[int] = []
        # Between two chunks of the prefill a cancel (or a refusal) stops the turn and undoes it.
        gate = PrefillGate(lambda: self._between_chunks(session))
        try:
            if session.cache is None:  # parked, restored from Redis, or after a failed step
                await self._step(lambda: self._materialize(session))
            cache = session.cache
            prefill_ids = session.token_ids[cache.history_len :]
            stats.prefilled_tokens = len(prefill_ids)
            try:
                logits = await self.batcher.prefill(session.id, cache, prefill_ids, max_new, gate)
            except ChunkUnavailable as exc:
                # Part of the cold history is unreadable (spilled to Redis, which is down now): the token
                # ids still hold all of it, so this same turn rebuilds the cache from them.
                log.warning("session %s: %s; re-prefilling its history in this turn", session.id, exc)
                cache = await self._step(lambda: self._rebuild_cache(session))
                self._admit(session, 0, max_new)  # the bound of a whole re-prefill, or a structured refusal
                stats.prefilled_tokens = len(session.token_ids)
                logits = await self.batcher.prefill(session.id, cache, session.token_ids, max_new, gate)
            self.memory_account.chunking.pop(session.id, None)  # compressed: back within its bound
            stats.ttft_ms = (time.perf_counter() - t0) * 1000
            with self.batcher.decoding():
                while True:
                    token = sample(logits, params, generator)
                    generated.append(token)
                    session.token_ids.append(token)
                    if token in self.chat_format.eos_ids:
                        finish = "stop"
                        break
                    delta = detok.add(token)
                    if delta:
                        yield TextDelta(delta)
                    if detok.stopped:
                        finish = "stop"
                        break
                    if len(generated) >= max_new or len(session.token_ids) >= self.max_context:
                        break
                    if session.cancel_requested:
                        finish = "cancelled"
                        break
                    logits = await self.batcher.decode(session.id, cache, token)
        except (GeneratorExit, asyncio.CancelledError):
            finish = "cancelled"
            raise
        except Exception as exc:
            if gate.undone:  # stopped between two chunks of the prefill (undone below)
                if not isinstance(exc, TurnCancelled):
                    raise  # a refusal, before anything was yielded
            else:
                log.exception("turn failed in session %s; its cache will be rebuilt", session.id)
                failed, session.cache = session.cache, None
                self.memory_account.set_held(session.id, 0)
                if failed is not None:
                    await self._step(lambda: self._release_quietly(session, failed))
                finish = "error"
                raise
        finally:
            if gate.undone:
                self._undo_turn(session, before, stats, t0)
            else:
                self._finish_turn(session, detok, generated, finish, stats, t0)
        if gate.undone:
            yield self._done_event(session, stats, "")
            return
        tail = detok.flush()
        if tail:
            yield TextDelta(tail)
        if self.redis is not None:
            await self._step(lambda: persist_session(self.redis, session))
        yield self._done_event(session, stats, detok.text)

    def _between_chunks(self, session: Session) -> None:
        """Model thread, between two chunks of a turn's prefill: a cancel ends the turn there, and so
        does a cache found past the device memory reserved for its turn (the bound did not hold)."""
        if session.cancel_requested:
            raise TurnCancelled("cancelled while the message was prefilled")
        mem = self.memory_account
        if mem.budget and mem.outgrown(session.id):
            mem.refusals += 1
            raise DeviceMemoryExhausted(
                "this turn's prefill outgrew the device memory reserved for it; the session is unchanged, retry later"
            )

    def _undo_turn(self, session: Session, before: tuple[int, int], stats: TurnStats, t0: float) -> None:
        """A turn stopped before its prefill ended: the session is as it was before it (its cache's
        chunks were taken back); only the returned stats tell of it."""
        del session.messages[before[0] :], session.token_ids[before[1] :]
        stats.finish_reason, stats.latency_ms = "cancelled", (time.perf_counter() - t0) * 1000
        if session.cache is not None:
            self.memory_account.set_held(session.id, session.cache.device_bytes())
        self.memory_account.reserved.pop(session.id, None)
        self.memory_account.chunking.pop(session.id, None)
        session.busy = False
        session.cancel_requested = False

    def _finish_turn(
        self, session: Session, detok: Detokenizer, generated: list[int], finish: str, stats: TurnStats, t0: float
    ) -> None:
        reply = {"role": "assistant", "content": detok.text}
        if finish == "cancelled":
            reply["cancelled"] = True
        if finish == "error":
            # Nothing of the failed reply is kept; the ids end with a closed (empty) assistant turn.
            del session.token_ids[len(session.token_ids) - len(generated) :]
            reply["error"] = True
        if finish in ("cancelled", "error", "length") or (generated and generated[-1] not in self.chat_format.eos_ids):
            session.token_ids.extend(self.chat_format.encode(self.chat_format.turn_end_text))
            reply["closed"] = True
        session.messages.append(reply)
        stats.generated_tokens = len(generated)
        stats.finish_reason = finish
        stats.latency_ms = (time.perf_counter() - t0) * 1000
        if session.cache is not None:
            session.cache.end_turn()
            stats.device_bytes = session.cache.device_bytes()
            stats.kept_tokens = session.cache.kept_tokens()
            stats.readmitted_tokens = session.cache.readmitted_tokens()
            self.memory_account.set_held(session.id, stats.device_bytes)
        self.memory_account.reserved.pop(session.id, None)
        self.memory_account.chunking.pop(session.id, None)
        session.turns.append(stats)
        session.busy = False
        session.cancel_requested = False
        session.last_used = time.time()

    def _done_event(self, session: Session, stats: TurnStats, text: str) -> TurnDone:
        return TurnDone(
            finish_reason=stats.finish_reason,
            text=text,
            usage=Usage(stats.prompt_tokens, stats.prefilled_tokens, stats.generated_tokens),
            memory=self.memory(session),
            ttft_ms=stats.ttft_ms,
            latency_ms=stats.latency_ms,
        )

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
        self.batcher.close()
        if self.redis is not None:
            self.redis.close()

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "Engine":
        return cls(settings or Settings())
