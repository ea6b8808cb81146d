"""Keep everything (``full``): the turn attends to the whole history, and all of it stays."""
from __future__ import annotations

import torch

from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.policy import CacheState, PrefillPolicy, TurnSize
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy


class KeepAll(PrefillPolicy):
    def __init__(self, cache: CacheState, tiers: TierContext | None = None) -> None:
        self.cache = cache

    def attend(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        store = self.cache.layers[layer]
        out = dense_attention(q, store.keys, store.values, scaling)
        self.select(layer, q, scaling)
        return out

    def select(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        self.cache.selected(layer, self.cache.layers[layer], None)

    @staticmethod
    def bound(turn: TurnSize, tiers: TierPolicy) -> int:
        return turn.token_bytes * turn.total

    @staticmethod
    def decode_tokens(turn: TurnSize) -> int:
        return turn.total
