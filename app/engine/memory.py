"""Device-memory accounting of one replica: what each session's cache holds on the device, what a
turn may grow it to, and the peak.

The device tier is the sessions' KV (and KT) caches, as ``SessionCache.device_bytes()`` counts
them. A turn is admitted only when the caches of all sessions, each at its current size or, while
generating, at the bound reserved for its turn, fit in the budget with this turn's bound; the
engine parks idle sessions to make room, or refuses the turn. The bound (``turn_bound``) is an
upper bound of the session's ``device_bytes()`` at every step of the turn, plus the per-layer
scratch its prefill needs (history keys and values streamed in for one layer at a time); each
mode declares its own (``rocketkv_mt.cache.CacheMode.device_bound``), so nothing here knows a mode.
Actual totals are taken after every model step (``observe``); ``overruns`` counts sessions found
above their reservation (a bound that does not hold; expected to stay 0).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from rocketkv_mt.cache import CacheSpec, TierPolicy, TurnSize, cache_mode

if TYPE_CHECKING:
    from app.engine.session import Session


class DeviceMemory:
    def __init__(self, budget: int, spec: CacheSpec, tiers: TierPolicy | None = None):
        self.budget = int(budget or 0)  # 0: unlimited (still accounted)
        self.tiers = tiers or TierPolicy()  # how tiered turns read cold pages back (their bound counts them)
        elem = torch.empty((), dtype=spec.dtype).element_size()
        self.per_layer_token = spec.num_kv_heads * spec.head_dim * 2 * elem  # K and V of one token, one layer
        self.per_token = self.per_layer_token * spec.num_layers
        self.head_dim = spec.head_dim
        self.held: dict[str, int] = {}  # device_bytes() of each session's cache, as last measured
        self.reserved: dict[str, int] = {}  # bound of each generating session's turn
        self.peak = 0
        self.current = 0
        self.parks = 0
        self.refusals = 0
        self.overruns = 0

    # --- bounds --------------------------------------------------------------------------------
    def turn_size(self, session: "Session", n_new: int, max_new: int) -> TurnSize:
        """The sizes of a turn that adds ``n_new`` tokens to the session's history (not yet in
        ``session.token_ids``) and generates up to ``max_new``."""
        cache = session.cache
        if cache is not None:
            fed, kept = cache.history_len, cache.kept_tokens()
        elif session.parked_kv is not None:  # restored from its record at the turn's start
            fed = int(session.parked_kv.get("history_len", 0))
            kept = session.turns[-1].kept_tokens if session.turns else fed
        else:  # rebuilt from the token ids: the whole history is prefilled
            fed, kept = 0, 0
        n = len(session.token_ids) + n_new - fed  # tokens this turn's prefill feeds
        total = fed + n + max_new
        m = max(0, min(max_new, total - 1))
        return TurnSize(
            fed=fed, kept=kept, new=n, total=total, decode=m, split=session.rocket.split(total, m, self.head_dim),
            token_bytes=self.per_token, layer_bytes=self.per_layer_token,
        )

    def turn_bound(self, session: "Session", n_new: int, max_new: int) -> int:
        """Upper bound of the session's device bytes while that turn runs: its mode's bound, and never
        less than what the session holds plus one layer of the new tokens."""
        turn = self.turn_size(session, n_new, max_new)
        held = session.cache.device_bytes() if session.cache is not None else 0
        return max(cache_mode(session.mode).device_bound(turn, self.tiers), held + self.per_layer_token * turn.new)

    # --- accounting ----------------------------------------------------------------------------
    def committed(self, session_ids: Iterable[str], exclude: str | None = None) -> int:
        """Bytes the sessions hold or have reserved (a generating session counts at its bound)."""
        return sum(
            max(self.held.get(sid, 0), self.reserved.get(sid, 0)) for sid in session_ids if sid != exclude
        )

    def set_held(self, session_id: str, nbytes: int) -> None:
        self.held[session_id] = int(nbytes)
        reserved = self.reserved.get(session_id)
        if reserved is not None and nbytes > reserved:
            self.overruns += 1

    def forget(self, session_id: str) -> None:
        self.held.pop(session_id, None)
        self.reserved.pop(session_id, None)

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
            "device_bytes_reserved": sum(self.reserved.values()),
            "peak_device_bytes": self.peak,
            "sessions_parked_total": self.parks,
            "turns_refused_device_memory": self.refusals,
            "device_reservation_overruns": self.overruns,
        }
