"""A cache mode: a name, a prefill policy and a decode policy, and the device-memory bound of the two."""
from __future__ import annotations

from dataclasses import dataclass

from rocketkv_mt.cache.policy import DecodePolicy, PrefillPolicy, TurnSize
from rocketkv_mt.cache.tier_context import TierPolicy


@dataclass(frozen=True)
class CacheMode:
    name: str
    prefill: type[PrefillPolicy]
    decode: type[DecodePolicy]

    def device_bound(self, turn: TurnSize, tiers: TierPolicy) -> int:
        """Upper bound of a session's ``device_bytes()`` at every step of ``turn``, plus the scratch its
        prefill needs; ``tiers``: the engine's cold-tier policy (only the modes that keep cold tokens read it)."""
        return self.prefill.bound(turn, tiers) + self.decode.bound(turn, self.prefill.decode_tokens(turn))
