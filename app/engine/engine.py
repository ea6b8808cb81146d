"""The chat engine: sessions that keep their KV cache between turns (no Ray, no HTTP).

``Engine.chat`` is the contract the serving layer builds on: an async iterator that yields
``TextDelta`` events as text becomes final and ends with exactly one ``TurnDone``. Errors in the
request raise an ``EngineError`` before anything is yielded and leave the session unchanged.
Closing the iterator early (or ``Engine.cancel``) ends the turn as ``cancelled``; the partial
reply is kept in the history, marked ``cancelled``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from app.engine.chat_format import ChatFormat
from app.engine.detokenizer import Detokenizer
from app.engine.errors import (
    ContextLengthExceeded,
    EmptyMessage,
    MessageTooLarge,
    SessionBusy,
    SessionNotFound,
    UnknownMode,
)
from app.engine.events import MemoryStats, TextDelta, TurnDone, Usage
from app.engine.model_runner import ModelRunner
from app.engine.persistence import persist_session, restore_session
from app.engine.sampling import SamplingParams, make_generator, sample
from app.engine.session import Session, TurnStats
from app.model_loader import LoadedModel, load_model
from app.settings import Settings
from rocketkv_mt.cache import CACHE_MODES, SessionCache, TierContext, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.host import HostTier
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
        self.sessions: dict[str, Session] = {}
        self.redis = (
            RedisTier(settings.redis_url, settings.redis_namespace, settings.redis_ttl_s) if settings.redis_url else None
        )
        self.host_tier = HostTier(settings.host_tier_bytes, self.redis)
        # One worker: model steps of all sessions run one at a time, interleaved step by step.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rkv-model")

    # --- sessions ----------------------------------------------------------------------------
    def create_session(
        self, mode: str | None = None, budget: int | None = None, system: str | None = None
    ) -> Session:
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
        sid = Session.new_id()
        session = Session(id=sid, mode=mode, rocket=rocket, cache=self.new_cache(mode, rocket, sid))
        if system:
            session.messages.append({"role": "system", "content": system})
        self.sessions[session.id] = session
        return session

    def new_cache(self, mode: str, rocket: RocketKVConfig, session_id: str = "local") -> SessionCache:
        """An empty cache of this engine's model; tiered caches keep cold tokens in this engine's tiers."""
        tiers = TierContext(
            host=self.host_tier,
            session_id=session_id,
            chunk_tokens=self.settings.chunk_tokens,
            prefill_attention=self.settings.prefill_attention,
        )
        return make_cache(mode, self.runner.spec, rocket, tiers=tiers)

    def get_session(self, session_id: str) -> Session:
        """A session of this engine, or one restored from Redis (another process may have written it)."""
        if not isinstance(session_id, str) or not session_id:
            raise SessionNotFound(f"no session {session_id!r}")
        session = self.sessions.get(session_id)
        if session is None and self.redis is not None:
            session = restore_session(self, session_id)
            if session is not None:
                self.sessions[session_id] = session
        if session is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return session

    def delete_session(self, session_id: str) -> None:
        session = self.get_session(session_id)
        if session.busy:
            raise SessionBusy("the session is generating; cancel it first")
        del self.sessions[session_id]
        if session.cache is not None:
            session.cache.release()
        if self.redis is not None:
            self.redis.delete_session(session_id)

    def cancel(self, session_id: str) -> bool:
        """Ask a generating session to stop after the current step; False if it was idle."""
        session = self.get_session(session_id)
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
            raise MessageTooLarge(f"max_tokens is over the limit of {self.settings.max_tokens_limit}")
        new_ids = self._turn_ids(session, content)
        total = len(session.token_ids) + len(new_ids)
        if total + 1 > self.max_context:
            raise ContextLengthExceeded(
                f"the conversation would be {total} tokens; the model context is {self.max_context} "
                "(the session is unchanged; start a new one or send less)"
            )
        return new_ids

    async def _step(self, fn: Callable[[], T]) -> T:
        """Run one model step on the model thread; a cancelled caller still waits for the step to end."""
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    async def chat(
        self, session_id: str, content: str, params: SamplingParams | None = None
    ) -> AsyncIterator[TextDelta | TurnDone]:
        """Validate and start a turn; returns the async iterator of its events."""
        session = self.get_session(session_id)
        params = params or SamplingParams()
        new_ids = self._validate(session, content, params)
        session.busy = True
        session.cancel_requested = False
        return self._run_turn(session, content, new_ids, params)

    async def complete(self, session_id: str, content: str, params: SamplingParams | None = None) -> TurnDone:
        """Run a whole turn and return its ``TurnDone``."""
        done = None
        async for event in await self.chat(session_id, content, params):
            if isinstance(event, TurnDone):
                done = event
        return done

    async def _run_turn(
        self, session: Session, content: str, new_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TextDelta | TurnDone]:
        t0 = time.perf_counter()
        session.messages.append({"role": "user", "content": content})
        session.token_ids.extend(new_ids)
        if session.cache is None:  # a failed step or a metadata-only restore: rebuild from the token ids
            session.cache = self.new_cache(session.mode, session.rocket, session.id)
        cache = session.cache
        prompt_tokens = len(session.token_ids)
        max_new = min(params.max_tokens or self.settings.max_new_tokens, self.max_context - prompt_tokens)
        prefill_ids = session.token_ids[cache.history_len :]
        stats = TurnStats(prompt_tokens=prompt_tokens, prefilled_tokens=len(prefill_ids))
        detok = Detokenizer(self.tokenizer, params.stop)
        generator = make_generator(params, self.runner.device)
        finish = "length"
        generated: list[int] = []
        try:
            logits = await self._step(lambda: self.runner.forward(prefill_ids, cache, prefill=True, max_new=max_new))
            stats.ttft_ms = (time.perf_counter() - t0) * 1000
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
                logits = await self._step(lambda: self.runner.forward([token], cache, prefill=False))
        except (GeneratorExit, asyncio.CancelledError):
            finish = "cancelled"
            raise
        except Exception:
            log.exception("turn failed in session %s; its cache will be rebuilt", session.id)
            session.cache = None
            finish = "error"
            raise
        finally:
            self._finish_turn(session, detok, generated, finish, stats, t0)
        tail = detok.flush()
        if tail:
            yield TextDelta(tail)
        if self.redis is not None:
            await self._step(lambda: persist_session(self, session))
        yield self._done_event(session, stats, detok.text)

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
        )

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.redis is not None:
            self.redis.close()

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "Engine":
        return cls(settings or Settings())
