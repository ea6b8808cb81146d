"""Device-memory accounting of one replica: what each session's cache holds on the device, what a
turn may grow it to, and the peak.

The device tier is the sessions' KV (and KT) caches, as ``SessionCache.device_bytes()`` counts
them. A turn is admitted only when the caches of all sessions, each at its current size or, while
generating, at the bound reserved for its turn, fit in the budget with this turn's bound; the
engine parks idle sessions to make room, or refuses the turn. The bound (``turn_bound``) is an
upper bound of the session's ``device_bytes()`` at every step of the turn, plus the per-layer
scratch its prefill needs (history keys and values streamed in for one layer at a time).
A prefill fed in chunks holds more than that while it is fed (``chunking``); the batcher feeds one
prefill in chunks at a time, so only the largest of these extras is committed.
Actual totals are taken after every model step (``observe``); ``overruns`` counts sessions found
above their reservation (a bound that does not hold; expected to stay 0).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

import torch

from rocketkv_mt.cache import CacheSpec
from rocketkv_mt.cold_select import pages_per_head

if TYPE_CHECKING:
    from app.engine.session import Session

HSA_MODES = ("rocketkv", "rocketkv-mt", "tiered")


class DeviceMemory:
    def __init__(self, budget: int, spec: CacheSpec, digest_candidates: float | None = None, page_tokens: int = 32):
        self.budget = int(budget or 0)  # 0: unlimited (still accounted)
        # Tiered turns read back every cold page (None) or this fraction of the prompt budget's worth.
        self.digest_candidates, self.page_tokens = digest_candidates, page_tokens
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

    # --- bounds --------------------------------------------------------------------------------
    def turn_bound(self, session: "Session", n_new: int, max_new: int, prefill_chunk: int = 0) -> int:
        """Upper bound of the session's device bytes while a turn that adds ``n_new`` tokens to its
        history (not yet in ``session.token_ids``) and generates up to ``max_new`` runs, its prefill
        split into chunks of ``prefill_chunk`` tokens (0: never split)."""
        cache = session.cache
        if cache is not None:
            fed, kept, held = cache.history_len, cache.kept_tokens(), cache.device_bytes()
        elif session.parked_kv is not None:  # restored from its record at the turn's start
            fed = int(session.parked_kv.get("history_len", 0))
            kept = session.turns[-1].kept_tokens if session.turns else fed
            held = 0
        else:  # rebuilt from the token ids: the whole history is prefilled
            fed, kept, held = 0, 0, 0
        n = len(session.token_ids) + n_new - fed  # tokens this turn's prefill feeds
        total = fed + n + max_new
        m = max(0, min(max_new, total - 1))
        split = session.rocket.split(total, m, self.head_dim)
        pb, page = split.prompt_budget, split.page_size
        pt, lt = self.per_token, self.per_layer_token
        # The new tokens sit uncompressed in one layer at a time until its prefill compresses it; in
        # every layer at once when the prefill is chunked (compression waits for its last chunk).
        chunked = 0 < prefill_chunk < n
        spread = pt if chunked else lt
        mode = session.mode
        if mode == "full":
            bound = pt * total
        elif mode == "rocketkv-mt":
            sparse = max(pb, kept) + m  # the per-turn selection (the old one is replaced layer by layer)
            bound = pt * total + pt * sparse + pt * (math.ceil(sparse / page) + 2) + lt * 2 * (fed + n)
        else:
            # snapkv, rocketkv, tiered: a layer holds its kept tokens plus the new ones only until its
            # own prefill compresses it; afterwards at most the prompt budget, then the decode tokens.
            kept_after = max(pb, kept) + m
            bound = pt * kept_after + spread * n
            if chunked:  # and the old KT pages of the layers not compressed yet
                bound += max(0, held - pt * kept)
            if mode in HSA_MODES:
                bound += pt * (math.ceil(kept_after / page) + 2)
            if mode == "tiered":
                if self.digest_candidates is None:
                    # Every cold page of one layer read back to score (keys and values), layer by layer.
                    bound += lt * 2 * (fed + n)
                else:
                    # The pages read back for every layer, held until its first decode step settles
                    # the selection, plus one layer's digests and attention scratch.
                    pages = pages_per_head(self.digest_candidates, pb, self.page_tokens)
                    bound += pt * min(fed, pages * self.page_tokens) + lt * 2 * (math.ceil(fed / self.page_tokens) + n)
        return max(bound, held + spread * n)

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
