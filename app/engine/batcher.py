"""Continuous batching: every model step of a replica runs on one model thread, as one forward over
all the sessions that have work at that moment.

Sessions ask from the event loop (``prefill``, ``decode``, ``run``) and await the answer. The model
thread loops:

1. one queued job, if any (a cache lifecycle operation: restore, park, persist), alternating with
   steps so that neither starves;
2. one step: the pending decode token of every session generating now, plus the oldest waiting
   prefill(s) (up to ``max_prefill_tokens`` new tokens, always at least one prefill), packed into
   one forward (``ModelRunner.step``). A new turn's prefill thus joins the running decodes: they
   are held up for one step, the one that carries it.

Before a step, the thread waits briefly (a fraction of the last step's time) until every session
in its decode phase has asked for its next token, so that they stay in one batch rather than
drifting into two; a session whose consumer is slow only costs that short wait.

Each request gets its own result: its next token, drawn on the model thread from its row of the
step's logits (all rows at once, one device-to-host transfer per step), or its own exception. A
cache that fails fails only its own request; a failure of the model itself fails every request of
that step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from app.engine.model_runner import ModelRunner, Segment
from app.engine.sampling import Sampler, sample_batch
from rocketkv_mt.cache import SessionCache

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PREFILL_TOKENS = 512  # prefill tokens packed into one step beyond the first prefill
GATHER_FRACTION = 0.25  # wait for stragglers at most this fraction of the last step's time
GATHER_MIN_S, GATHER_MAX_S = 0.001, 0.05


class EngineClosed(RuntimeError):
    pass


@dataclass
class _Request:
    key: str  # the session id, for accounting
    segment: Segment
    sampler: Sampler  # how its next token is drawn
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class BatchStats:
    steps: int = 0  # forwards run
    decode_tokens: int = 0  # decode segments over all steps
    decode_steps: int = 0  # steps with at least one decode segment
    prefill_tokens: int = 0
    prefills: int = 0
    max_batch: int = 0  # most segments in one step
    mixed_steps: int = 0  # steps that carried a prefill together with decode tokens
    jobs: int = 0
    failed_segments: int = 0  # segments whose cache raised (only that session failed)
    failed_steps: int = 0  # forwards that raised outside the caches (every segment failed)
    busy_s: float = 0.0  # time spent in steps and jobs

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["mean_decode_batch"] = round(self.decode_tokens / max(1, self.decode_steps), 2)
        out["busy_s"] = round(self.busy_s, 3)
        return out


class Batcher:
    """The model thread of an engine and its queues (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        on_step: Callable[[list[str]], None] | None = None,
        max_prefill_tokens: int = MAX_PREFILL_TOKENS,
        threads: int | None = None,
    ):
        self.runner = runner
        self.on_step = on_step
        self.max_prefill_tokens = max_prefill_tokens
        self.threads = threads
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._prefills: deque[_Request] = deque()
        self._decodes: list[_Request] = []
        self._decoding = 0  # sessions between their prefill and the end of their turn
        self._last_step_s = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rkv-model", daemon=True)
        self._thread.start()

    # --- event-loop side -----------------------------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Queue ``fn`` to run on the model thread (between steps); returns its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                fut.set_exception(EngineClosed("the engine is closed"))
                return fut
            self._jobs.append((fn, fut))
            self._cond.notify()
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model thread and return its result."""
        return await _wait(self.submit(fn))

    async def prefill(self, key: str, cache: SessionCache, ids: list[int], max_new: int, sampler: Sampler) -> int:
        """Feed a turn's new tokens; returns the token drawn after the last one."""
        segment = Segment(cache, list(ids), prefill=True, max_new=max_new)
        return await self._request(_Request(key, segment, sampler), True)

    async def decode(self, key: str, cache: SessionCache, token: int, sampler: Sampler) -> int:
        """Feed one generated token; returns the next one."""
        return await self._request(_Request(key, Segment(cache, [token]), sampler), False)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """Marks a session as generating: the model thread waits (briefly) for its next token."""
        with self._cond:
            self._decoding += 1
        try:
            yield
        finally:
            with self._cond:
                self._decoding -= 1
                self._cond.notify()

    async def _request(self, req: _Request, prefill: bool) -> int:
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            (self._prefills.append if prefill else self._decodes.append)(req)
            self._cond.notify()
        return await _wait(req.future)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=60)

    # --- model thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.threads and self.runner.device.type == "cpu":
            torch.set_num_threads(self.threads)  # per-thread in some builds: set it on the model thread too
        job_turn = True
        while True:
            with self._cond:
                while not (self._jobs or self._prefills or self._decodes or self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                steps_waiting = bool(self._prefills or self._decodes)
                if self._jobs and (job_turn or not steps_waiting):
                    job = self._jobs.popleft()
                    job_turn = False
                else:
                    job = None
                    job_turn = True
                    self._gather()
                    batch = self._take()
            if job is not None:
                self._run_job(*job)
            elif batch:
                self._run_step(batch)
        self._fail_pending()

    def _gather(self) -> None:
        """Wait (lock held) until every generating session has asked, or a short while has passed."""
        wait = min(GATHER_MAX_S, max(GATHER_MIN_S, GATHER_FRACTION * self._last_step_s))
        deadline = time.monotonic() + wait
        while len(self._decodes) < self._decoding and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _take(self) -> list[_Request]:
        batch, self._decodes = self._decodes, []
        budget = self.max_prefill_tokens
        first = True
        while self._prefills and (first or len(self._prefills[0].segment.ids) <= budget):
            req = self._prefills.popleft()
            budget -= len(req.segment.ids)
            batch.append(req)
            first = False
        return batch

    def _run_job(self, fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        t0 = time.perf_counter()
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)
        finally:
            self.stats.jobs += 1
            self.stats.busy_s += time.perf_counter() - t0

    def _run_step(self, batch: list[_Request]) -> None:
        t0 = time.perf_counter()
        segments = [r.segment for r in batch]
        try:
            logits, errors = self.runner.step(segments)
            ok = [i for i in range(len(batch)) if i not in errors]
            rows = logits if len(ok) == len(batch) else logits[ok]
            tokens = dict(zip(ok, sample_batch(rows, [batch[i].sampler for i in ok]) if ok else []))
        except BaseException as exc:  # noqa: BLE001 - the model failed: every segment of the step did
            log.exception("a batched step of %d segments failed", len(batch))
            self.stats.failed_steps += 1
            for r in batch:
                r.future.set_exception(exc)
            self._account(batch, t0)
            return
        for i, r in enumerate(batch):
            if i in errors:
                self.stats.failed_segments += 1
                r.future.set_exception(errors[i])
            else:
                r.future.set_result(tokens[i])
        self._account(batch, t0)

    def _account(self, batch: list[_Request], t0: float) -> None:
        st = self.stats
        st.steps += 1
        st.max_batch = max(st.max_batch, len(batch))
        prefills = sum(1 for r in batch if r.segment.prefill)
        st.prefills += prefills
        st.prefill_tokens += sum(len(r.segment.ids) for r in batch if r.segment.prefill)
        st.decode_tokens += len(batch) - prefills
        st.decode_steps += prefills < len(batch)
        st.mixed_steps += bool(prefills and prefills < len(batch))
        if self.on_step is not None:
            try:
                self.on_step([r.key for r in batch])
            except Exception:  # noqa: BLE001 - accounting must not break serving
                log.exception("step accounting failed")
        self._last_step_s = time.perf_counter() - t0
        st.busy_s += self._last_step_s

    def _fail_pending(self) -> None:
        with self._cond:
            pending = [r.future for r in [*self._prefills, *self._decodes]] + [f for _, f in self._jobs]
            self._prefills.clear()
            self._decodes.clear()
            self._jobs.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(EngineClosed("the engine is closed"))


async def _wait(fut: concurrent.futures.Future) -> Any:
    """Await a model-thread future; a cancelled caller still waits for the work to end (the cache
    it touches must not be used or changed meanwhile), then sees its cancellation."""
    afut = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(afut)
    except asyncio.CancelledError:
        await asyncio.wait([afut])
        raise
