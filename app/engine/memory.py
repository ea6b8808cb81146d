"""Device-memory accounting of one replica: what each session's cache holds on the device, what a
turn may grow it to, and the peak.

The device tier is the sessions' KV (and KT) caches, as ``SessionCache.device_bytes()`` counts
them. A turn is admitted only when the caches of all sessions, each at its current size or, while
generating, at the bound reserved for its turn, fit in the budget with this turn's bound; the
engine parks idle sessions to make room, or refuses the turn. The bound (``turn_bound``) is an
upper bound of the session's ``device_bytes()`` at every step of the turn, plus the per-layer
scratch its prefill needs (history keys and values streamed in for one layer at a time); each
mode declares its own (``rocketkv_mt.cache.CacheMode.device_bound``), so nothing here knows a mode.
A prefill fed in chunks holds more than that while it is fed (its new tokens sit in every layer
until the last chunk compresses them): the difference is the turn's ``chunking`` extra; the
batcher feeds one prefill in chunks at a time, so only the largest of these extras is committed.
A first prompt is fed layer by layer instead (``app.engine.layer_prefill``): one layer of it at a
time, as a whole prefill holds it, so it has no such extra and several may run at once.
A turn that rebuilds a lost cache by replaying the session's turns is bounded by the largest bound of
the turns it replays (``replay_sizes``), as they hold the history again one by one.
Actual totals are taken after every model step (``observe``); ``overruns`` counts sessions found
above their reservation (a bound that does not hold; expected to stay 0).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterable

import torch

from app.engine.steps import by_layer
from rocketkv_mt.cache import CacheSpec, TierPolicy, TurnSize, cache_mode

if TYPE_CHECKING:
    from app.engine.session import Feed, Session


def parked_cold_pages(state: dict) -> int | None:
    """The most live cold pages a KV head had in a layer when the session was parked, as its KV record
    says (``SessionCache.persist``); None where the record does not say (one written before it did)."""
    pages = state.get("cold_pages")
    return pages if type(pages) is int and pages >= 0 else None


class DeviceMemory:
    def __init__(self, budget: int, spec: CacheSpec, tiers: TierPolicy | None = None, layered: bool = True):
        self.budget = int(budget or 0)  # 0: unlimited (still accounted)
        self.layered = layered  # the model's first prompts may be fed layer by layer (``ModelRunner.layerable``)
        self.tiers = tiers or TierPolicy()  # how tiered turns read cold pages back (their bound counts them)
        elem = torch.empty((), dtype=spec.dtype).element_size()
        self.per_layer_token = spec.num_kv_heads * spec.head_dim * 2 * elem  # K and V of one token, one layer
        self.per_token = self.per_layer_token * spec.num_layers
        self.head_dim = spec.head_dim
        self.held: dict[str, int] = {}  # device_bytes() of each session's cache, as last measured
        self.reserved: dict[str, int] = {}  # bound of each generating session's turn
        self.chunking: dict[str, int] = {}  # what a turn's chunked prefill may hold beyond that, until it ends
        self.peak = 0
        self.current = 0
        self.parks = 0
        self.refusals = 0
        self.overruns = 0
        # A session's cache is measured on the model thread after each step and taken away (parked, or
        # dropped after a failure) on the event loop: one at a time, or a measure begun before the cache
        # was taken would write its size back after the 0, and a parked session would seem to hold it.
        self._cache_lock = threading.Lock()

    # --- bounds --------------------------------------------------------------------------------
    def turn_size(self, session: "Session", n_new: int, max_new: int, prefill_chunk: int = 0) -> TurnSize:
        """The sizes of a turn that adds ``n_new`` tokens to the session's history (not yet in
        ``session.token_ids``) and generates up to ``max_new``, its prefill split into chunks of
        ``prefill_chunk`` tokens (0: never split)."""
        cache = session.cache
        cold_pages = None  # not known: the mode's bound assumes the most pages the history could fill
        if cache is not None:
            fed, kept, cold_pages = cache.history_len, cache.kept_tokens(), cache.cold_pages()
        elif session.parked_kv is not None:  # restored from its record at the turn's start
            fed = int(session.parked_kv.get("history_len", 0))
            kept = session.turns[-1].kept_tokens if session.turns else fed
            cold_pages = parked_cold_pages(session.parked_kv)
        else:  # rebuilt from the token ids: the whole history is prefilled
            fed, kept, cold_pages = 0, 0, 0
        return self._size(session, fed, kept, cold_pages, len(session.token_ids) + n_new - fed, max_new, prefill_chunk)

    def replay_sizes(
        self, session: "Session", feeds: "list[Feed]", n_new: int, max_new: int, prefill_chunk: int = 0
    ) -> list[TurnSize]:
        """The sizes of a turn that first rebuilds the session's cache by replaying ``feeds`` into an empty
        one (``app.engine.replay``): each replayed turn's, then its own prefill's (what the feeds leave of
        the history, and its ``n_new`` tokens). The cache was lost, so what each replayed turn holds is
        not known: at most what the turn before it could keep at its end; its cold pages, the most the
        history could fill."""
        sizes: list[TurnSize] = []
        fed = kept = 0
        for feed in feeds:
            sizes.append(self._size(session, fed, kept, None, feed.prefill, feed.max_new, prefill_chunk))
            fed, kept = fed + feed.prefill + feed.decodes, sizes[-1].kept_after
        n = len(session.token_ids) + n_new - fed
        return [*sizes, self._size(session, fed, kept, None, n, max_new, prefill_chunk)]

    def _size(
        self, session: "Session", fed: int, kept: int, cold_pages: int | None, n: int, max_new: int, prefill_chunk: int
    ) -> TurnSize:
        """A turn that feeds ``n`` tokens to a cache fed ``fed`` (holding ``kept``) and generates up to ``max_new``."""
        total = fed + n + max_new
        m = max(0, min(max_new, total - 1))
        return TurnSize(
            fed=fed, kept=kept, new=n, total=total, decode=m, split=session.rocket.split(total, m, self.head_dim),
            token_bytes=self.per_token, layer_bytes=self.per_layer_token,
            # A later turn is fed layer by layer only by a mode that does so once cold pages exist (not
            # known: counted as chunked, the larger reservation).
            chunked=0 < prefill_chunk < n and not by_layer(
                fed, n, prefill_chunk, self.layered,
                self.layered and bool(cold_pages) and cache_mode(session.mode).layers_later(self.tiers)),
            cold_pages=cold_pages,
        )

    def turn_bound(
        self, session: "Session", n_new: int, max_new: int, prefill_chunk: int = 0, replay: "list[Feed] | None" = None
    ) -> int:
        """Upper bound of the session's device bytes while that turn runs: its mode's bound, and never
        less than what the session holds plus the new tokens not compressed yet (one layer of them, or
        every layer while a chunked prefill is fed). A turn that replays ``replay`` into an empty cache
        first is bounded by the largest bound of the turns it feeds: it holds the history it rebuilds,
        which the bound of one prefill into an empty cache would not count (the pages each replayed turn
        reads back)."""
        mode = cache_mode(session.mode)
        if replay is not None:
            return max(mode.device_bound(t, self.tiers) for t in self.replay_sizes(session, replay, n_new, max_new,
                                                                                   prefill_chunk))
        turn = self.turn_size(session, n_new, max_new, prefill_chunk)
        held = session.cache.device_bytes() if session.cache is not None else 0
        return max(mode.device_bound(turn, self.tiers), held + turn.uncompressed_bytes)

    # --- accounting ----------------------------------------------------------------------------
    def committed(self, session_ids: Iterable[str], exclude: str | None = None, chunking: int = 0) -> int:
        """Bytes the sessions hold or have reserved (a generating session counts at its bound), plus the
        largest extra of a chunked prefill among theirs and ``chunking`` (the next turn's)."""
        ids = [sid for sid in session_ids if sid != exclude]
        extras = [self.chunking.get(sid, 0) for sid in ids]
        held = sum(
            max(self.held.get(sid, 0) - extra, self.reserved.get(sid, 0)) for sid, extra in zip(ids, extras)
        )
        return held + max([chunking, *extras])

    def outgrown(self, session_id: str) -> bool:
        """Whether a generating session holds more than its turn reserved (its bound did not hold)."""
        reserved = self.reserved.get(session_id)
        return reserved is not None and self.held.get(session_id, 0) > reserved + self.chunking.get(session_id, 0)

    def set_held(self, session_id: str, nbytes: int) -> None:
        self.held[session_id] = int(nbytes)
        if self.outgrown(session_id):
            self.overruns += 1

    def measure(self, session: "Session") -> None:
        """Record what the session's cache holds now (nothing when it has none)."""
        with self._cache_lock:
            if session.cache is not None:
                self.set_held(session.id, session.cache.device_bytes())

    def take_cache(self, session: "Session"):
        """Take the session's cache away (its caller parks or frees it): it holds nothing from now."""
        with self._cache_lock:
            cache, session.cache = session.cache, None
            self.set_held(session.id, 0)
        return cache

    def forget(self, session_id: str) -> None:
        self.held.pop(session_id, None)
        self.reserved.pop(session_id, None)
        self.chunking.pop(session_id, None)

    def observe(self, session_ids: Iterable[str]) -> int:
        """Total held by these sessions now; raises the peak."""
        ids = set(session_ids)
        if len(self.held) > 2 * len(ids) + 16:  # sessions dropped from memory elsewhere
            for sid in [sid for sid in list(self.held) if sid not in ids]:
                self.forget(sid)
        self.current = sum(self.held.get(sid, 0) for sid in ids)
        self.peak = max(self.peak, self.current)
        return self.current

    def stats(self) -> dict[str, int]:
        return {
            "device_budget_bytes": self.budget,
            "device_bytes_held": self.current,
            "device_bytes_reserved": sum(self.reserved.values()) + max(self.chunking.values(), default=0),
            "peak_device_bytes": self.peak,
            "sessions_parked_total": self.parks,
            "turns_refused_device_memory": self.refusals,
            "device_reservation_overruns": self.overruns,
        }
