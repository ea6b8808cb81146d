"""Continuous batching: every model step of a replica runs on one model thread, as one forward over
all the sessions that have work at that moment.

Sessions ask from the event loop (``prefill``, ``decode``, ``run``) and await the answer. The model
thread loops:

1. one queued job, if any (a cache lifecycle operation: restore, park, persist, a turn's settle),
   alternating with steps so that neither starves; jobs run in order, and one on a cache whose last
   layer still settles on the page reader waits for that (with those behind it) while steps run;
2. one step: the pending decode token of every session generating now, plus prefill tokens of the
   oldest waiting turn(s), packed into one forward (``ModelRunner.step``). A step carries at most
   ``prefill_chunk`` prefill tokens (``MAX_PREFILL_TOKENS`` when chunking is off, and then always at
   least one whole prefill): a longer prefill is split into chunks fed by consecutive steps, each of
   which also carries the decode tokens of the sessions generating meanwhile, so they keep
   streaming while it is fed (the cache defers its compression to the last chunk, see
   ``SessionCache``; a cache that cannot split its prefill is fed whole). While others decode, such
   a chunk is sized to add about one decode step's time to the step (``chunk_budget``: the median of
   the recent decode-only steps over what the prefill's chunks cost a token), so their tokens keep
   coming at close to their own pace however long the history the chunk attends to; alone, or while
   more turns wait for their first token than sessions decode, the prefill takes whole
   ``prefill_chunk``s.

After a chunked prefill's last chunk, its cache still has each layer's end of prefill to run
(``SessionCache.select_pending``: Stage 1 over the whole history, eviction or demotion, KT). While
other sessions have steps to run, that session's first decode waits, and the selection runs in
slices between their steps, each about half a decode-only step's time; so no step the others
wait for carries the whole history's selection at once. With nothing else to run it goes at once.

Between two chunks, the turn's ``PrefillGate`` is checked and the caller's cancellation seen: a
stopped prefill takes its chunks back (``SessionCache.undo_chunks``), leaving the cache as before.

A session's first prompt longer than ``prefill_chunk`` is fed layer by layer instead
(``app.engine.layer_prefill``), so its cache never holds the whole prompt in every layer: not a
segment of a step but slices of work between steps, each running groups of one layer's rows until
about half a decode-only step's time has passed (a quarter second when nobody decodes; a slice
may cross layers), the groups sized on what a row cost while others wait (whole ``prefill_chunk``
groups when none do). Up to ``MAX_LAYERED`` such prefills take slices in turn, so long prompts
advance together, each holding one layer of itself at a time (and its hidden states: activations
outside the device budget, hence the cap); between two slices, and before the first, its gate is
checked as between chunks, and a stopped one is taken back (``SessionCache.undo_layered``).

Before a step, the thread waits briefly (a fraction of the last step's time) until every session
in its decode phase has asked for its next token, so that they stay in one batch rather than
drifting into two; a session whose consumer is slow only costs that short wait. An idle engine's first
prefill waits likewise while more turns keep arriving (each within ``ARRIVAL_QUIET_S`` of the last,
``ARRIVAL_MAX_S`` in all): turns sent together start in one step, rather than the first taking a step
alone while the others queue behind it.

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
from typing import Any, TypeVar

import torch

from app.engine.layer_prefill import LayerPrefill
from app.engine.model_runner import ModelRunner, Segment
from app.engine.sampling import TokenSampler, sample_batch
from app.engine.steps import (
    BatchStats,
    PrefillAbandoned,
    PrefillGate,
    RecentMedian,
    Request,
    StepLog,
    StepRecord,
    by_layer,
    chunk_budget,
    take,
)
from rocketkv_mt.cache import SessionCache

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PREFILL_TOKENS = 512  # prefill tokens packed into one step beyond the first prefill, without chunking
GATHER_FRACTION = 0.25  # wait for stragglers at most this fraction of the last step's time
GATHER_MIN_S, GATHER_MAX_S = 0.001, 0.05
# An idle engine's first prefill waits for more turns while they keep arriving (each within QUIET of the
# last, MAX in all), so a burst of turns shares one step instead of the first taking a step alone.
ARRIVAL_QUIET_S, ARRIVAL_MAX_S = 0.002, 0.02
SELECT_FRACTION = 0.5  # a slice of a chunked prefill's deferred selection: about this fraction of a decode step
SELECT_MIN_S = 0.005
MIN_CHUNK = 4  # fewest prefill tokens a chunk fed beside decode tokens carries
DECODE_WINDOW = 9  # decode-only steps whose median is the reference step time
TOKEN_EMA = 0.5  # weight of the newest chunk in a chunked prefill's running cost per token
SETTLE_POLL_S = 0.002  # how often a job waiting for the page reader looks again while nothing else runs
ALONE_SLICE_S = 0.25  # a slice of a prefill fed layer by layer while nobody decodes (new turns get in between)
MAX_LAYERED = 2  # prefills fed layer by layer at once (each carries its prompt's hidden states); more wait


class EngineClosed(RuntimeError):
    pass


class Batcher:
    """The model thread of an engine and its queues (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        on_step: Callable[[list[str]], None] | None = None,
        prefill_chunk: int = 0,
        threads: int | None = None,
        flush_denormal: bool = False,
    ):
        self.runner = runner
        self.on_step = on_step
        self.prefill_chunk = prefill_chunk  # 0: prefills are never split
        self.step_tokens = prefill_chunk or MAX_PREFILL_TOKENS
        self.threads = threads
        self.flush_denormal = flush_denormal
        self.stats = BatchStats()
        self.step_log: StepLog | None = None  # set to record every step (benchmarks)
        self._cond = threading.Condition()
        # Jobs in order, each with the cache it waits for to be ready (``submit``), if any.
        self._jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future, SessionCache | None]] = deque()
        self._prefills: deque[Request] = deque()
        self._decodes: list[Request] = []
        self._selecting: list[Request] = []  # decodes held back while their cache's selection runs (model thread)
        self._unselected: list[SessionCache] = []  # caches past a chunked prefill, selection not done (model thread)
        self._layered: deque[Request] = deque()  # prefills fed layer by layer, in arrival order
        self._slices = 0  # slices given so far: the next goes to the next of the first MAX_LAYERED
        self._finish_first = False  # run those selections before the next step (model thread)
        self._decoding = 0  # sessions between their prefill and the end of their turn
        self._last_step_s = 0.0
        self._decode = RecentMedian(DECODE_WINDOW)  # time of a step that carries only decode tokens
        self._token_s: float | None = None  # the last chunk's seconds per prefill token (any prefill)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rkv-model", daemon=True)
        self._thread.start()

    # --- event-loop side -----------------------------------------------------------------------
    def submit(self, fn: Callable[[], T], after: SessionCache | None = None) -> concurrent.futures.Future:
        """Queue ``fn`` to run on the model thread (between steps, jobs in order); returns its future.
        ``after``: a cache whose last layer may still settle on the page reader (``decode_ready``): the
        job, and those queued behind it, wait for that while steps run, rather than wait in it on
        the model thread, which every stream would see."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                fut.set_exception(EngineClosed("the engine is closed"))
                return fut
            self._jobs.append((fn, fut, after))
            self._cond.notify()
        return fut

    async def run(self, fn: Callable[[], T], after: SessionCache | None = None) -> T:
        """Run ``fn`` on the model thread and return its result (``after`` as for ``submit``)."""
        return await _wait(self.submit(fn, after))

    async def prefill(
        self, key: str, cache: SessionCache, ids: list[int], max_new: int, sampler: TokenSampler,
        gate: PrefillGate | None = None,
    ) -> int:
        """Feed a turn's new tokens; returns the token drawn after the last one.

        Fed in chunks or layer by layer, it checks ``gate`` between two of them: when the check
        raises, or the caller is cancelled, the prefill is taken back (``gate.undone``) and this
        raises that exception (or the cancellation)."""
        # Read while the session's turn holds its cache: no step touches it before this request runs (and
        # only for a prompt long enough to be split at all).
        layered = 0 < self.prefill_chunk < len(ids) and self.runner.layerable and by_layer(
            cache.history_len, len(ids), self.prefill_chunk, cache.last_chunk_min() is not None, cache.layers_later())
        return await self._request(Request(key, cache, list(ids), prefill=True, max_new=max_new, gate=gate,
                                           sampler=sampler, by_layer=layered))

    async def decode(self, key: str, cache: SessionCache, token: int, sampler: TokenSampler) -> int:
        """Feed one generated token; returns the next one."""
        return await self._request(Request(key, cache, [token], sampler=sampler))

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

    async def _request(self, req: Request) -> int:
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if req.by_layer:
                self._layered.append(req)
            elif req.prefill:
                self._prefills.append(req)
            else:
                self._decodes.append(req)
            self._cond.notify()
        return await _wait(req.future, req)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=60)

    # --- model thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.threads and self.runner.device.type == "cpu":
            torch.set_num_threads(self.threads)  # per-thread in some builds: set it on the model thread too
        if self.flush_denormal:
            torch.set_flush_denormal(True)  # a per-thread CPU mode (see Settings.flush_denormal)
        job_turn = True
        while True:
            with self._cond:
                while not (self._job_ready() or self._prefills or self._decodes or self._selecting or self._layered
                           or self._closed):
                    # Nothing tells when the page reader is done with a job's cache: look again shortly.
                    self._cond.wait(SETTLE_POLL_S if self._jobs else None)
                if self._closed:
                    break
                steps_waiting = bool(self._prefills or self._decodes or self._selecting or self._layered)
                if self._job_ready() and (job_turn or not steps_waiting):
                    job = self._jobs.popleft()[:2]
                    job_turn = False
                else:
                    job = None
                    job_turn = True
                    self._gather()
                    batch = self._take()
                    layered = self._next_layered()
                    others = bool(batch or self._selecting or self._decoding)
            if job is not None:
                self._run_job(*job)
                continue
            if self._finish_first:
                self._finish_first = False
                for cache in self._unselected:
                    cache.select_pending()
                self._unselected = []
            if self._selecting:
                self._select_slice()
            if batch:
                self._run_step(batch)
            if layered is not None:
                self._layered_slice(layered, others)
        self._fail_pending()

    def _job_ready(self) -> bool:
        """Lock held: whether the next job may run now (the cache it waits for, if any, is ready)."""
        if not self._jobs:
            return False
        after = self._jobs[0][2]
        return after is None or after.decode_ready()

    def _gather(self) -> None:
        """Wait (lock held) until every generating session has asked, or a short while has passed; on an
        idle engine, while new turns keep arriving (``ARRIVAL_QUIET_S``)."""
        if self._prefills and not (self._prefills[0].fed or self._decoding or self._decodes or self._selecting):
            self._gather_arrivals()
            return
        wait = min(GATHER_MAX_S, max(GATHER_MIN_S, GATHER_FRACTION * self._last_step_s))
        deadline = time.monotonic() + wait
        while len(self._decodes) + len(self._selecting) < self._decoding and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _gather_arrivals(self) -> None:
        """Lock held: wait until no turn has arrived for ``ARRIVAL_QUIET_S``, ``ARRIVAL_MAX_S`` at most."""
        deadline = time.monotonic() + ARRIVAL_MAX_S
        seen = len(self._prefills)
        while not self._closed:
            left = min(ARRIVAL_QUIET_S, deadline - time.monotonic())
            if left <= 0:
                return
            self._cond.wait(left)
            if len(self._prefills) == seen:
                return
            seen = len(self._prefills)

    def _take(self) -> list[tuple[Request, Segment]]:
        """The step's segments (lock held); see ``take``. A decode whose cache has selection left, or
        whose last layer is still settling on the page reader, is held back (``_selecting``) while there
        are other segments to run."""
        ready = []
        for r in self._decodes:
            (self._selecting if _held_back(r.cache) else ready).append(r)
        self._decodes = []
        budget = self.step_tokens
        head = self._prefills[0] if self._prefills else None
        chunked_head = head is not None and 0 < self.prefill_chunk < len(head.ids)  # fed in chunks
        # One prefill's uncompressed chunks sit in the layers at a time (the device budget commits one
        # such extra per replica, ``DeviceMemory``): the next long prefill starts once the selections
        # earlier ones deferred are done; meanwhile the others decode (and the selections run in
        # slices), or, with no one decoding, those selections finish before this step.
        self._unselected = [c for c in self._unselected if c.unselected_layers()]
        if self._unselected and chunked_head and head.fed == 0:
            if ready:
                return take(ready, deque(), budget, chunking=False)
            self._finish_first = True
        # Thin chunks favour the sessions streaming: only a prefill fed in chunks anyway (its turn
        # reserved device memory for that) is cut finer, and not while more turns wait for their first
        # token than sessions decode (a burst of new conversations).
        if chunked_head and len(ready) >= len(self._prefills):
            budget = chunk_budget(self._decode.value, head.token_s or self._token_s, self.step_tokens, MIN_CHUNK,
                                  head.last_chunk)
        batch = take(ready, self._prefills, budget, chunking=self.prefill_chunk > 0)
        if not batch and self._selecting:  # nobody to hold up: they select in this step, inline
            batch = take(self._selecting, deque(), self.step_tokens, chunking=False)
            self._selecting = []
        return batch

    def _select_slice(self) -> None:
        """Model thread: the held-back decodes whose caches are ready join the next step; then part of
        the oldest selection left runs (its decode joins once it is done and, where part of it runs on
        the page reader, that is done too)."""
        ready, waiting = [], []
        for r in self._selecting:
            (waiting if _held_back(r.cache) else ready).append(r)
        self._selecting = waiting
        if ready:
            with self._cond:
                self._decodes.extend(ready)
        req = next((r for r in self._selecting if r.cache.unselected_layers()), None)
        if req is None:  # only the page reader's work is left: nothing to slice here
            return
        t0 = time.perf_counter()
        try:
            # Sized on a decode-only step: after a step that carried a chunk, half of it would add up.
            slice_s = max(SELECT_MIN_S, SELECT_FRACTION * (self._decode.value or self._last_step_s))
            left = req.cache.select_pending(t0 + slice_s)
        except Exception as exc:  # noqa: BLE001 - that session fails alone, as a failed step segment does
            self._selecting.remove(req)
            self.stats.failed_segments += 1
            req.future.set_exception(exc)
        else:
            if not left and req.cache.decode_ready():
                self._selecting.remove(req)
                with self._cond:
                    self._decodes.append(req)
        self.stats.selection_slices += 1
        self.stats.busy_s += time.perf_counter() - t0

    def _next_layered(self) -> Request | None:
        """Lock held: the prefill fed layer by layer that gets the next slice, in turn among the first
        ``MAX_LAYERED`` (None when there is none)."""
        if not self._layered:
            return None
        self._slices += 1
        return self._layered[self._slices % min(len(self._layered), MAX_LAYERED)]

    def _layered_slice(self, req: Request, others: bool) -> None:
        """Model thread: a slice of a prefill fed layer by layer (started here on its first slice); at
        its end, its first token is drawn and handed over."""
        if self._stopped(req):
            return
        if others and req.plan is not None and not req.plan.ready():
            # Its next layer would wait for the layer before it, applying its choice on the page reader:
            # the others' next step runs meanwhile.
            self.stats.layered_deferred += 1
            return
        t0 = time.perf_counter()
        slice_s = (max(SELECT_MIN_S, SELECT_FRACTION * (self._decode.value or self._last_step_s)) if others
                   else ALONE_SLICE_S)
        first_layer = req.plan.layer if req.plan is not None else 0
        try:
            if req.plan is None:
                req.plan = LayerPrefill(self.runner.model, req.cache, req.ids, req.max_new, self.step_tokens)
            req.plan.advance(t0 + slice_s, fit=others)
            token = None
            if req.plan.done:
                logits = req.plan.finish()
                token = sample_batch(logits.unsqueeze(0), [req.sampler])[0]
        except BaseException as exc:  # noqa: BLE001 - that session fails alone; its cache is rebuilt
            log.warning("a prefill fed layer by layer failed: %r", exc)
            self.stats.failed_segments += 1
            self._fail(req, exc)
            return
        finally:
            self.stats.layered_slices += 1
            self.stats.busy_s += time.perf_counter() - t0
        last_layer = req.plan.layer - (req.plan.offset == 0)
        ended = req.plan.n if token is not None else 0  # a prompt's tokens count once, when all layers had them
        if self.step_log is not None:
            self.step_log.add(StepRecord(ended, 1, 0, time.perf_counter() - t0, (req.key, first_layer, last_layer)))
        if token is not None:
            self.stats.prefill_tokens += ended
            self.stats.prefills += 1
            with self._cond:
                self._layered.remove(req)
            req.future.set_result(token)
        self._report([req.key])  # the cache's size after the slice: the peak, and an outgrown bound

    def _report(self, keys: list[str]) -> None:
        """Hand the sessions a step or slice touched to ``on_step`` (the engine's memory accounting)."""
        if self.on_step is not None:
            try:
                self.on_step(keys)
            except Exception:  # noqa: BLE001 - accounting must not break serving
                log.exception("step accounting failed")

    def _stopped(self, req: Request) -> bool:
        """Model thread, before a chunk that continues a prefill or any slice of one fed layer by layer:
        stop it there if its turn asks to (``gate.check`` raises) or its caller is gone; what it fed is
        taken back."""
        if not req.prefill or not (req.fed or req.by_layer):
            return False
        try:
            if req.abandoned:
                raise PrefillAbandoned("the caller is gone")
            if req.gate is not None:
                req.gate.check()
            return False
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            reason: BaseException = exc
        try:
            if req.plan is not None:
                req.cache.undo_layered()
            elif req.fed:
                req.cache.undo_chunks()
        except Exception as exc:  # noqa: BLE001 - the cache is half-undone: it fails as a cache failure does
            reason = exc
        else:
            if req.gate is not None:
                req.gate.undone = True
            self.stats.prefills_stopped += 1
        self._fail(req, reason)
        return True

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

    def _fail(self, req: Request, exc: BaseException) -> None:
        """End a request with ``exc``; a prefill fed in part leaves the queue."""
        with self._cond:
            if req in self._prefills:
                self._prefills.remove(req)
            if req in self._layered:
                self._layered.remove(req)
        req.future.set_exception(exc)

    def _run_step(self, batch: list[tuple[Request, Segment]]) -> None:
        batch = [(r, s) for r, s in batch if not self._stopped(r)]
        if not batch:
            return
        t0 = time.perf_counter()
        try:
            logits, errors = self.runner.step([s for _, s in batch])
            # Only a segment that ends its request draws a token (a prefill's earlier chunks do not).
            done = [i for i, (_, s) in enumerate(batch) if i not in errors and not s.rest]
            rows = logits if len(done) == len(batch) else logits[done]
            tokens = dict(zip(done, sample_batch(rows, [batch[i][0].sampler for i in done]) if done else []))
        except BaseException as exc:  # noqa: BLE001 - the model failed: every segment of the step did
            log.exception("a batched step of %d segments failed", len(batch))
            self.stats.failed_steps += 1
            for r, _ in batch:
                self._fail(r, exc)
            self._account(batch, t0)
            return
        self._record(batch, t0)
        for i, (r, s) in enumerate(batch):
            if i in errors:
                self.stats.failed_segments += 1
                self._fail(r, errors[i])
            elif s.rest:
                r.fed += len(s.ids)  # the prefill stays first in the queue for its next chunk
            else:
                if r.prefill and r.fed and r.cache.unselected_layers():  # a chunked prefill's last chunk
                    self._unselected.append(r.cache)
                r.future.set_result(tokens[i])
        self._account(batch, t0)

    def _record(self, batch: list[tuple[Request, Segment]], t0: float) -> None:
        """Add the step to ``step_log``, if one is set, before its requests get their results: a caller
        that has its answer finds the step that made it there."""
        if self.step_log is not None:
            prefills = [s for _, s in batch if s.prefill]
            self.step_log.add(StepRecord(sum(len(s.ids) for s in prefills), len(prefills), len(batch) - len(prefills),
                                         time.perf_counter() - t0))

    def _account(self, batch: list[tuple[Request, Segment]], t0: float) -> None:
        step_s = time.perf_counter() - t0
        decoding = [s for _, s in batch if not s.prefill]
        if len(decoding) == len(batch):
            self._decode.add(step_s)
        for r, s in batch:
            if s.prefill and s.rest:  # a chunk: what it cost a token, beyond the decode tokens beside it
                extra = step_s - (self._decode.value if decoding else 0.0)
                token_s = max(extra, 0.1 * step_s) / len(s.ids)
                # A running mean over the prefill's chunks: one step's time on a noisy machine is not its cost.
                r.token_s = token_s if r.token_s is None else (1 - TOKEN_EMA) * r.token_s + TOKEN_EMA * token_s
                self._token_s = r.token_s
                r.last_chunk = len(s.ids)
        st = self.stats
        st.steps += 1
        st.max_batch = max(st.max_batch, len(batch))
        prefills = [s for _, s in batch if s.prefill]
        st.prefills += sum(1 for s in prefills if not s.rest)
        st.prefill_chunks += sum(1 for s in prefills if s.rest)
        st.prefill_tokens += sum(len(s.ids) for s in prefills)
        st.decode_tokens += len(batch) - len(prefills)
        st.decode_steps += len(prefills) < len(batch)
        st.mixed_steps += bool(prefills and len(prefills) < len(batch))
        self._report([r.key for r, _ in batch])
        self._last_step_s = time.perf_counter() - t0
        st.busy_s += self._last_step_s

    def _fail_pending(self) -> None:
        with self._cond:
            pending = [r.future for r in [*self._prefills, *self._decodes, *self._selecting, *self._layered]]
            pending += [job[1] for job in self._jobs]
            self._prefills.clear()
            self._layered.clear()
            self._decodes.clear()
            self._selecting.clear()
            self._unselected.clear()
            self._jobs.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(EngineClosed("the engine is closed"))


def _held_back(cache: SessionCache) -> bool:
    """Whether a decode waits out of the steps: its cache has selection left, or its last layer is still
    settling on the page reader."""
    return bool(cache.unselected_layers()) or not cache.decode_ready()


async def _wait(fut: concurrent.futures.Future, req: Request | None = None) -> Any:
    """Await a model-thread future; a cancelled caller still waits for the work to end (the cache
    it touches must not be used or changed meanwhile; a prefill in chunks ends at the next
    boundary), then sees its cancellation."""
    afut = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(afut)
    except asyncio.CancelledError:
        if req is not None:
            req.abandoned = True
        await asyncio.wait([afut])
        if not afut.cancelled():
            afut.exception()  # seen here: nobody else will ask for it
        raise
