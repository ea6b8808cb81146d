"""Dense decode: every token of the decode set, exactly; the cost grows with the set."""
from __future__ import annotations

import torch

from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.base import CacheSpec
from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.cache.policy import TurnSize
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import BudgetSplit


class DenseDecode:
    """Holds nothing besides the KV."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec

    def prepare(self, layer: int, store: LayerKV, scores: torch.Tensor | None, split: BudgetSplit, lead: int) -> None:
        return None

    def attend(self, layer: int, q: torch.Tensor, store: LayerKV, split: BudgetSplit, scaling: float) -> torch.Tensor:
        """q (Hq, 1, d) -> (Hq, 1, d)."""
        return dense_attention(q, store.keys, store.values, scaling)

    def target(self, layer: int, store: LayerKV, split: BudgetSplit, mirror: LayerKV | None, lead: int) -> DecodeTarget:
        return DecodeTarget(store, mirror, lead=lead)

    def nbytes(self) -> int:
        return 0

    @staticmethod
    def bound(turn: TurnSize, decode_tokens: int) -> int:
        return 0
