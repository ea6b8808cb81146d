"""What the model thread's steps are made of: the requests sessions queue (a decode token, a turn's
prefill), how one step takes them, and the statistics of the steps run.

A step takes every pending decode token, then prefill tokens of the oldest waiting turns up to a
budget. Without chunking, the first waiting prefill is taken whole and later ones only if they fit.
With chunking, a prefill larger than what is left of the budget is split: this step feeds a chunk
and the prefill stays first in the queue for the next step; its last chunk keeps at least the
tokens its cache needs there (``SessionCache.last_chunk_min``), and a cache that
cannot split its prefill is fed whole.
"""
from __future__ import annotations

import concurrent.futures
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.engine.model_runner import Segment
from app.engine.sampling import TokenSampler
from rocketkv_mt.cache import SessionCache

GROWTH = 1.5  # a chunk fed beside decode tokens is at most this many times the prefill's last chunk


class PrefillAbandoned(RuntimeError):
    """A prefill fed in chunks or layer by layer whose caller was cancelled, stopped at a boundary."""


@dataclass(eq=False)
class PrefillGate:
    """A turn's hold on its prefill while that is fed in chunks or layer by layer."""

    check: Callable[[], None] = lambda: None  # model thread, between two chunks or slices: raises to stop there
    undone: bool = False  # set when the prefill was stopped between chunks and its chunks taken back


@dataclass(eq=False)
class Request:
    """One session's ask: ``ids`` to feed on top of ``cache`` (one decode token, or a turn's prefill)."""

    key: str  # the session id, for accounting
    cache: SessionCache
    ids: list[int]
    prefill: bool = False
    max_new: int = 0
    gate: PrefillGate | None = None
    sampler: TokenSampler | None = None  # how the token after its last id is drawn (on the model thread)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    fed: int = 0  # tokens of ``ids`` that earlier steps fed (a prefill in chunks)
    token_s: float | None = None  # a prefill in chunks: seconds per token of its chunks (running)
    last_chunk: int = 0  # a prefill in chunks: tokens of its last chunk
    abandoned: bool = False  # the caller was cancelled: a prefill in pieces stops at the next boundary
    by_layer: bool = False  # fed layer by layer (``by_layer``), in slices between steps
    plan: Any = None  # then its ``LayerPrefill`` once started (model thread)

    def segment(self, n: int) -> Segment:
        """The next ``n`` tokens as one step's segment."""
        rest = len(self.ids) - self.fed - n
        return Segment(self.cache, self.ids[self.fed : self.fed + n], self.prefill, self.max_new, rest)


def by_layer(history_len: int, n_new: int, prefill_chunk: int, first: bool, later: bool) -> bool:
    """Whether a prefill is fed layer by layer (``app.engine.layer_prefill``): a prompt longer than one
    step's ``prefill_chunk``, into an empty (or rebuilt) cache where ``first`` (the model's layout allows
    it and the cache can split its prefill), or into one holding history where ``later`` (its prefill
    policy feeds later turns so, ``SessionCache.layers_later``); others are fed in chunks or whole."""
    return 0 < prefill_chunk < n_new and (later if history_len else first)


def take(
    decodes: list[Request], prefills: deque[Request], budget: int, chunking: bool
) -> list[tuple[Request, Segment]]:
    """One step's segments: every decode request, then prefill tokens up to ``budget``, oldest first.
    Prefills taken whole leave ``prefills``; one taken in part stays first there. A step that ends
    a prefill fed in chunks starts no other in part: one prefill's chunks sit uncompressed at a time."""
    batch = [(r, r.segment(1)) for r in decodes]
    left = budget
    ended_chunks = False  # a prefill fed in chunks ends in this step
    while prefills:
        req = prefills[0]
        n = piece(req, left, first=left == budget, chunking=chunking)
        if n == 0 or (ended_chunks and n < len(req.ids) - req.fed):
            break  # (the next one's chunks start after that one's deferred selection)
        ended_chunks = ended_chunks or req.fed > 0
        segment = req.segment(n)
        batch.append((req, segment))
        left -= n
        if segment.rest:
            break
        prefills.popleft()
    return batch


def piece(req: Request, budget: int, first: bool, chunking: bool) -> int:
    """How many of a prefill's tokens still to feed a step takes (0: none, it waits)."""
    left = len(req.ids) - req.fed
    if left <= budget:
        return left
    last = req.cache.last_chunk_min() if chunking else None
    if last is not None and min(budget, left - last) > 0:
        return min(budget, left - last)  # the last chunk keeps at least ``last`` tokens
    return left if first else 0


def chunk_budget(decode_s: float, token_s: float | None, most: int, least: int, last: int = 0) -> int:
    """Prefill tokens for a step that carries other sessions' decode tokens too: about as many as
    add ``decode_s`` (what a step of those decode tokens alone takes) at ``token_s`` seconds a
    prefill token (measured on the prefill's chunks; it grows with the history the chunk attends
    to), within [least, most], and at most ``GROWTH`` times the ``last`` chunk (when there was one):
    one cheap-looking chunk on a noisy machine must not make the next one several times larger.
    Unknown costs (no chunk fed yet, no decode step timed) give ``least``."""
    if not token_s or decode_s <= 0:
        return least
    if last:
        most = min(most, max(least, int(GROWTH * last)))
    return max(least, min(most, int(decode_s / token_s)))


class RecentMedian:
    """The median of the last ``n`` values added (0.0 before any): a reference step time that a few
    slow steps do not move, as a running mean would (the event loop reading a long message, or a
    collection, can make two or three decode steps twice as long just before that message's chunks
    are sized on them)."""

    def __init__(self, n: int):
        self._values: deque[float] = deque(maxlen=n)

    def add(self, value: float) -> None:
        self._values.append(value)

    @property
    def value(self) -> float:
        return statistics.median(self._values) if self._values else 0.0


@dataclass(frozen=True)
class StepRecord:
    """One model step: its prefill tokens and segments (chunks included), decode tokens, and seconds;
    for a slice of a prefill fed layer by layer, its session and the layers it ran (first, last)."""

    prefill_tokens: int
    prefills: int
    decodes: int
    seconds: float
    layered: tuple[str, int, int] | None = None


class StepLog:
    """The last ``n`` steps a batcher ran (``Batcher.step_log``), for benchmarks that ask where a
    phase's time went; a batcher without one records nothing."""

    def __init__(self, n: int = 100_000):
        self._records: deque[StepRecord] = deque(maxlen=n)
        self._added = 0

    def add(self, record: StepRecord) -> None:
        self._records.append(record)
        self._added += 1

    def __len__(self) -> int:
        """Steps recorded so far, those no longer kept included."""
        return self._added

    def since(self, start: int) -> list[StepRecord]:
        """The steps recorded from the ``start``-th on (``len`` before a phase), of those still kept."""
        first_kept = self._added - len(self._records)
        return list(self._records)[max(0, start - first_kept):]


@dataclass
class BatchStats:
    steps: int = 0  # forwards run
    decode_tokens: int = 0  # decode segments over all steps
    decode_steps: int = 0  # steps with at least one decode segment
    prefill_tokens: int = 0
    prefills: int = 0  # prefills fed to their end
    prefill_chunks: int = 0  # chunks fed that were not the last of their prefill
    prefills_stopped: int = 0  # prefills stopped between two chunks (their chunks taken back)
    max_batch: int = 0  # most segments in one step
    mixed_steps: int = 0  # steps that carried a prefill together with decode tokens
    jobs: int = 0
    selection_slices: int = 0  # slices of a chunked prefill's deferred selection run between steps
    layered_slices: int = 0  # slices of prefills fed layer by layer run between steps
    layered_deferred: int = 0  # times their next slice was put off: the layer before still applied its choice
    failed_segments: int = 0  # segments whose cache raised (only that session failed)
    failed_steps: int = 0  # forwards that raised outside the caches (every segment failed)
    busy_s: float = 0.0  # time spent in steps and jobs

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["mean_decode_batch"] = round(self.decode_tokens / max(1, self.decode_steps), 2)
        out["busy_s"] = round(self.busy_s, 3)
        return out
