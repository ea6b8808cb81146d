"""Evict once (SnapKV): Stage 1 at every turn's prefill over what the device holds; the tokens it
drops are gone for good."""
from __future__ import annotations

import torch

from rocketkv_mt import dispatch
from rocketkv_mt.anchors import kept_scores
from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.policy import CacheState, PrefillPolicy, TurnSize
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy
from rocketkv_mt.stage1 import keep_from_scores


class EvictOnce(PrefillPolicy):
    def __init__(self, cache: CacheState, tiers: TierContext | None = None) -> None:
        self.cache = cache

    def attend(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        store = self.cache.layers[layer]
        out = dense_attention(q, store.keys, store.values, scaling)
        self.select(layer, self.cache.split.window_of(q), scaling)
        return out

    def select(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        cache = self.cache
        store, split = cache.layers[layer], cache.split
        if store.length <= split.prompt_budget:
            cache.selected(layer, store, None)
            return
        w = q_win.shape[1]
        scores = dispatch.window_scores(q_win, store.keys, scaling, backend=cache.spec.kernels)
        keep = keep_from_scores(scores, w, split.prompt_budget, split.kernel_size)
        store.keep(keep)
        cache.selected(layer, store, kept_scores(scores, keep[:, : keep.shape[1] - w], w))

    @staticmethod
    def bound(turn: TurnSize, tiers: TierPolicy) -> int:
        """A layer holds its kept tokens plus the new ones only until its own prefill compresses it;
        afterwards at most the prompt budget, then the decode tokens."""
        return turn.token_bytes * turn.kept_after + turn.uncompressed_bytes

    @staticmethod
    def decode_tokens(turn: TurnSize) -> int:
        return turn.kept_after
