"""Host-tier admission of one replica's turns: a turn holds the host slots it may demote pages into before
it runs, so that the host tier's hard bound refuses a turn up front (``host_memory_exhausted``, the
session unchanged) rather than half way through it.

A turn's need is its mode's bound of the cold pages it writes (``CacheMode.cold_pages_written``) over
every layer and KV head: nothing for the modes that keep nothing off the device. While the host tier
can spill to Redis nothing is held (resident pages make way); with no Redis, or while its circuit is
open, the slots must be free beside what other turns hold (``tiers.host.tier.HostTier.reserve``).

Called by the engine's admission (``app.engine.residency``) and when a turn ends (``app.engine.turns``).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from app.engine.errors import HostMemoryExhausted
from rocketkv_mt.cache import CacheSpec, TierPolicy, TurnSize, cache_mode
from tiers.host.tier import HostTier

if TYPE_CHECKING:
    from app.engine.session import Session


class HostMemory:
    def __init__(self, tier: HostTier, spec: CacheSpec, tiers: TierPolicy):
        self.tier, self.tiers = tier, tiers
        self.layer_heads = spec.num_layers * spec.num_kv_heads
        self.refusals = 0  # turns refused for want of host memory, before or during their run
        self._jobs = itertools.count()  # names what ``set_aside`` holds

    def pages(self, session: "Session", turn: TurnSize) -> int:
        """The most pages the turn may write to the host tier."""
        return self.layer_heads * cache_mode(session.mode).cold_pages_written(turn, self.tiers)

    def reserve(self, session: "Session", turn: TurnSize) -> None:
        """Hold the host room of a session's next turn (replacing what it held), or raise
        ``HostMemoryExhausted`` holding nothing."""
        pages = self.pages(session, turn)
        if not self.tier.reserve(session.id, pages):
            tier = self.tier
            raise self.refuse(
                f"this turn may demote up to {pages * tier.page_bytes} bytes of cold KV to the host tier, which has "
                f"{tier.free_bytes()} of its {tier.capacity_bytes} free beside the turns in flight, and nothing can "
                "spill to Redis now; the session is unchanged: retry later, send less, or delete idle sessions"
            )

    def release(self, session_id: str) -> None:
        self.tier.release(session_id)

    def set_aside(self, session_id: str) -> str:
        """Keep the host room of a session's ended turn held for a job of that turn still to run (it
        may demote pages), apart from the session's next turn; returns its holder for ``release``."""
        holder = f"{session_id}#job{next(self._jobs)}"
        self.tier.set_aside(session_id, holder)
        return holder

    def refuse(self, message: str) -> HostMemoryExhausted:
        """The error that refuses a turn for want of host memory, counted."""
        self.refusals += 1
        return HostMemoryExhausted(message)

    def stats(self) -> dict[str, int]:
        return {
            "host_capacity_bytes": self.tier.capacity_bytes,
            "host_bytes_reserved": self.tier.reserved_bytes(),
            "turns_refused_host_memory": self.refusals,
        }
