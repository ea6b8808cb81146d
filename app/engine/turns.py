"""A turn through the engine: its checks, then prefill and decode on the model thread, streamed.

``chat`` validates a turn, admits it within the device budget and returns the async iterator of its
events (``TextDelta``s, then one ``TurnDone``; before them ``TurnStatus``es while it rebuilds a lost
cache, ``app.engine.replay``); ``_run_turn`` is that iterator. A turn stopped
between two chunks of its prefill, or two slices of a first prompt fed layer by layer
(``_between_chunks``, or its caller gone), is undone: the session is as it was before it, its feed
log included; so is one whose demotions found the host tier full before it sent anything
(``host_memory_exhausted``). A mixin of ``Engine`` (``app.engine.engine``), working on the engine's
state named below.
"""
from __future__ import annotations

import asyncio
import logging
import time
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from app.engine.admission import AdmissionQueue
from app.engine.batcher import Batcher
from app.engine.chat_format import ChatFormat
from app.engine.detokenizer import Detokenizer
from app.engine.errors import (
    ContextLengthExceeded,
    DeviceMemoryExhausted,
    EmptyMessage,
    MaxTokensTooLarge,
    MessageTooLarge,
    SessionBusy,
    TurnCancelled,
)
from app.engine.events import MemoryStats, TextDelta, TurnDone, TurnStatus, Usage
from app.engine.host_memory import HostMemory
from app.engine.memory import DeviceMemory
from app.engine.model_runner import ModelRunner
from app.engine.sampling import SamplingParams, TokenSampler
from app.engine.session import Feed, Session, TurnStats
from app.engine.steps import PrefillGate
from app.settings import Settings
from rocketkv_mt.cache import SessionCache
from tiers.host.tier import ChunkUnavailable, HostFull

log = logging.getLogger(__name__)
T = TypeVar("T")


class TurnLoop:
    # The engine's state and methods a turn uses (``Engine`` and ``DeviceResidency``).
    settings: Settings
    tokenizer: object
    runner: ModelRunner
    chat_format: ChatFormat
    max_context: int
    memory_account: DeviceMemory
    host_memory: HostMemory
    batcher: Batcher
    get_session: Callable[[str], Session]
    memory: Callable[[Session], MemoryStats]
    _admit_in_turn: Callable[[Session, int, int, list[Feed] | None], Awaitable[None]]
    admissions: AdmissionQueue
    _materialize: Callable[[Session], None]
    _release_quietly: Callable[[Session, SessionCache], None]
    _drop_if_broken: Callable[[Session, SessionCache], None]
    # A lost cache rebuilt (``app.engine.replay.CacheRebuild``).
    _replay_plan: Callable[[Session], list[Feed] | None]
    _rebuild: Callable[[Session, int, PrefillGate], AsyncIterator[TurnStatus]]

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

    async def _step(self, fn: Callable[[], T], after: SessionCache | None = None) -> T:
        """Run ``fn`` on the model thread, between batched steps; a cancelled caller still waits for it.
        ``after``: a cache it waits for, off that thread, to be ready (``Batcher.submit``)."""
        return await self.batcher.run(fn, after)

    async def chat(
        self, session_id: str, content: str, params: SamplingParams | None = None
    ) -> AsyncIterator[TextDelta | TurnStatus | TurnDone]:
        """Validate and start a turn; returns the async iterator of its events."""
        session = self.get_session(session_id)
        params = params or SamplingParams()
        new_ids = self._validate(session, content, params)
        prompt_tokens = len(session.token_ids) + len(new_ids)
        max_new = min(params.max_tokens or self.settings.max_new_tokens, self.max_context - prompt_tokens)
        # A session whose cache was lost (an earlier rebuild was stopped) replays its log first: its
        # admission counts that too.
        replay = self._replay_plan(session)
        session.busy = True  # no other turn of this session while this one waits for device memory
        session.turns_begun += 1
        try:
            await self._admit_in_turn(session, len(new_ids), max_new, replay)
        except BaseException:
            session.busy = False
            raise
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
    ) -> AsyncIterator[TextDelta | TurnStatus | TurnDone]:
        t0 = time.perf_counter()
        before = len(session.messages), len(session.token_ids)
        session.messages.append({"role": "user", "content": content})
        session.token_ids.extend(new_ids)
        stats = TurnStats(prompt_tokens=len(session.token_ids), prefilled_tokens=0)
        detok = Detokenizer(self.tokenizer, params.stop)
        sampler = TokenSampler(params, self.runner.device, session.token_ids)  # drawn on the model thread
        finish = "length"
        left = False  # the caller went away (a disconnect, a cancelled task): no TurnDone is read
        generated: list[int] = []
        # Between two chunks of the prefill a cancel (or a refusal) stops the turn and undoes it.
        gate = PrefillGate(lambda: self._between_chunks(session))
        fed = 0  # what the cache had been fed when this turn began (set once it has one)
        try:
            if session.cache is None:  # parked, restored from Redis, or after a failed step
                await self._step(lambda: self._materialize(session))  # a restore that failed: lost
            elif session.cache.broken and session.cache.history_len:
                # A job on it (a left turn's settle, a persist) failed half-way since this turn was
                # admitted: no turn runs on it; it is rebuilt as a lost cache is, within its own bounds.
                session.lost_fed = session.cache.history_len
            cache, ids = session.cache, session.token_ids
            fed = cache.history_len
            if not session.lost_fed:
                if fed == 0:
                    session.feeds.clear()
                stats.prefilled_tokens = len(ids) - fed
                try:
                    token = await self.batcher.prefill(session.id, cache, ids[fed:], max_new, sampler, gate)
                except ChunkUnavailable as exc:
                    # Part of the cold history is unreadable (spilled to Redis, which is down now): the token
                    # ids still hold all of it, so this same turn rebuilds the cache from them.
                    log.warning("session %s: %s", session.id, exc)
                    session.lost_fed = fed
            if session.lost_fed:
                async with contextlib.aclosing(self._rebuild(session, max_new, gate)) as statuses:
                    async for status in statuses:
                        yield status
                cache = session.cache
                fed = cache.history_len
                stats.prefilled_tokens = len(ids)  # the replayed history was fed again too
                try:
                    token = await self.batcher.prefill(session.id, cache, ids[fed:], max_new, sampler, gate)
                except ChunkUnavailable as exc:  # what the rebuild spilled, Redis lost meanwhile
                    raise await self._rebuilt_unreadable(session, fed, gate) from exc
            session.feeds.append(Feed(len(ids) - fed, max_new))
            stats.ttft_ms = (time.perf_counter() - t0) * 1000
            with self.batcher.decoding():
                while True:
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
                    token = await self.batcher.decode(session.id, cache, token, sampler)
                    session.feeds[-1].decodes += 1
                    # A chunked prefill's layers have all selected by the first decode step: compressed,
                    # the session is back within its bound.
                    if self.memory_account.chunking.pop(session.id, 0):
                        self.admissions.changed()
            if not session.feeds[-1].decodes:
                # The reply ended at its first token: what the prefill left to settle (a deferred
                # selection, tiered's re-selection) runs on the model thread, which alone touches the
                # tiers while steps run; a decode step would have settled it. The job waits for the
                # page reader's part outside the model thread, as a held-back decode does.
                await self._step(cache.end_turn, after=cache)
        except (GeneratorExit, asyncio.CancelledError):
            finish = "cancelled"
            left = True
            raise
        except HostFull as exc:
            # The host tier filled up after admission (Redis failed meanwhile): the half-demoted cache goes,
            # and a turn that sent nothing yet is undone, as a refusal at admission leaves it.
            failed = self.memory_account.take_cache(session)
            if failed is not None:
                await self._step(lambda: self._release_quietly(session, failed))
            gate.undone = not generated
            if gate.undone:  # the next turn rebuilds the very cache this one began with, by replay
                session.lost_fed = session.lost_fed or fed
            finish = "error"
            raise self.host_memory.refuse(f"{exc}; the turn was stopped") from exc
        except Exception as exc:
            if gate.undone:  # stopped between two chunks of the prefill (undone below)
                if not isinstance(exc, TurnCancelled):
                    raise  # a refusal, before anything was yielded
            else:
                log.exception("turn failed in session %s; its cache will be rebuilt", session.id)
                failed = self.memory_account.take_cache(session)
                if failed is not None:
                    await self._step(lambda: self._release_quietly(session, failed))
                finish = "error"
                raise
        finally:
            if gate.undone:
                self._undo_turn(session, before, stats, t0)
            else:
                self._finish_turn(session, detok, generated, finish, stats, t0, left)
        if gate.undone:
            yield self._done_event(session, stats, "")
            return
        tail = detok.flush()
        if tail:
            yield TextDelta(tail)
        yield self._done_event(session, stats, detok.text)

    def _between_chunks(self, session: Session) -> None:
        """Model thread, between two chunks (or slices) of a turn's prefill: a cancel ends the turn there,
        and so does a cache found past the device memory reserved for its turn (the bound did not hold)."""
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
        chunks were taken back, no feed was logged); only the returned stats tell of it."""
        del session.messages[before[0] :], session.token_ids[before[1] :]
        stats.finish_reason, stats.latency_ms = "cancelled", (time.perf_counter() - t0) * 1000
        if session.cache is not None:
            self.memory_account.set_held(session.id, session.cache.device_bytes())
        self.memory_account.reserved.pop(session.id, None)
        self.memory_account.chunking.pop(session.id, None)
        self.host_memory.release(session.id)
        self.admissions.changed()
        session.busy = False
        session.cancel_requested = False

    def _finish_turn(
        self, session: Session, detok: Detokenizer, generated: list[int], finish: str, stats: TurnStats, t0: float,
        left: bool,
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
        cache = session.cache
        if cache is None:
            self._close_turn(session, stats)
        elif left:
            self._close_left_turn(session, cache, stats)
        else:  # every other way out settled on the model thread (a decode step, or the job above)
            self._close_turn(session, stats, _measure(cache))

    def _close_left_turn(self, session: Session, cache: SessionCache, stats: TurnStats) -> None:
        """A turn its caller left (a disconnect, a cancelled task), possibly before any decode step: its
        cache may still hold the prefill's re-selection to settle, which moves bytes between the tiers.
        Only the model thread touches the tiers while steps run, so it settles there, as a job; this
        method cannot wait for it (it runs while the turn's generator is closed). The session is free
        at once: a next turn that begins first settles it itself (``begin_turn``), and the job then
        leaves the cache alone. The turn's host room stays held until the job ends, apart from a next
        turn's (which may be refused meanwhile): the settle may still demote pages into the host tier."""
        fed = cache.history_len
        held = self.host_memory.set_aside(session.id)
        self._close_turn(session, stats, _measure(cache))

        def settle() -> tuple[int, int, int] | None:
            # Parked, or a later turn began (its forward may be under way: fed layer by layer, the
            # history grows only at its end); that turn settled the cache itself.
            if session.cache is not cache or cache.history_len != fed or cache.step is not None:
                return None
            try:
                cache.end_turn()
            except Exception:
                self._drop_if_broken(session, cache)
                raise
            return _measure(cache)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # finalised outside the loop: the next turn's prefill, or a persist, settles it
            self.host_memory.release(held)
            return

        def settled(fut) -> None:
            measured = None
            if fut.exception() is not None:  # the cache as it was, or dropped if the failure broke it
                log.warning("session %s: a left turn's settle failed (%s)", session.id, fut.exception())
            else:
                measured = fut.result()
            loop.call_soon_threadsafe(self._record_settled, session, cache, fed, stats, measured, held)

        self.batcher.submit(settle, after=cache).add_done_callback(settled)

    def _record_settled(self, session: Session, cache: SessionCache, fed: int, stats: TurnStats,
                        measured: tuple[int, int, int] | None, held: str) -> None:
        """Loop thread, after a left turn's settle job: the host room set aside for it is free, and its
        figures are the session's unless a next turn began meanwhile."""
        self.host_memory.release(held)
        if measured is not None:
            stats.device_bytes, stats.kept_tokens, stats.readmitted_tokens = measured
            if session.cache is cache and cache.history_len == fed and not session.busy:
                self.memory_account.set_held(session.id, stats.device_bytes)
        self.admissions.changed()

    def _close_turn(self, session: Session, stats: TurnStats, measured: tuple[int, int, int] | None = None) -> None:
        """Record the turn's memory figures and free the session for its next turn."""
        if measured is not None:
            stats.device_bytes, stats.kept_tokens, stats.readmitted_tokens = measured
            self.memory_account.set_held(session.id, stats.device_bytes)
        self.memory_account.reserved.pop(session.id, None)
        self.memory_account.chunking.pop(session.id, None)
        self.host_memory.release(session.id)
        self.admissions.changed()
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


def _measure(cache: SessionCache) -> tuple[int, int, int]:
    """(device bytes, kept tokens, re-admitted tokens) of a cache at a turn's end."""
    return cache.device_bytes(), cache.kept_tokens(), cache.readmitted_tokens()
