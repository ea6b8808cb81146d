"""A cache mode: a name, a prefill policy and a decode policy, and the device-memory bound of the two."""
from __future__ import annotations

import math
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

    def layers_later(self, tiers: TierPolicy) -> bool:
        """Whether a later turn's prefill is fed layer by layer (``PrefillPolicy.layers_later``)."""
        return self.prefill.layers_later(tiers)

    def cold_pages_written(self, turn: TurnSize, tiers: TierPolicy) -> int:
        """Upper bound of the cold pages ``turn`` writes per KV head and layer (each head pads its last)."""
        return math.ceil(self.prefill.cold_tokens_written(turn) / tiers.page_tokens)
