"""Re-select over the device (``rocketkv-mt``, the paper's multi-turn variant): the whole history
stays on the device; every turn re-runs Stage 1 over all of it with the new observation window,
into a per-turn selection that decode reads."""
from __future__ import annotations

import torch

from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.policy import CacheState, PrefillPolicy, TurnSize
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy
from rocketkv_mt.dispatch import reselect
from rocketkv_mt.take_rows import take_rows


class ReselectDevice(PrefillPolicy):
    def __init__(self, cache: CacheState, tiers: TierContext | None = None) -> None:
        self.cache = cache
        s = cache.spec
        self.selection = [LayerKV(s.num_kv_heads, s.head_dim, s.dtype, s.device) for _ in range(s.num_layers)]

    def attend(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        full = self.cache.layers[layer]
        out = dense_attention(q, full.keys, full.values, scaling)
        self.select(layer, self.cache.split.window_of(q), scaling)
        return out

    def select(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        cache = self.cache
        full, turn, split = cache.layers[layer], self.selection[layer], cache.split
        scores = None
        if full.length <= split.prompt_budget:
            turn.replace(full.keys, full.values, full.positions)
        else:
            slots, positions, scores = reselect(
                q_win, full.keys, full.positions, None, full.length, split.prompt_budget, split.kernel_size, scaling,
                backend=cache.spec.kernels,
            )
            turn.replace(take_rows(full.keys, slots), take_rows(full.values, slots), positions)
        cache.selected(layer, turn, scores)

    def extend_decode_set(self, layer: int) -> LayerKV:
        """The turn's selection, with the token being decoded (the layer store's newest) copied in."""
        full = self.cache.layers[layer]
        self.selection[layer].append(full.keys[:, -1:], full.values[:, -1:], full.positions[:, -1:])
        return self.selection[layer]

    def decode_set(self, layer: int) -> LayerKV | None:
        return self.selection[layer]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.selection)

    @staticmethod
    def bound(turn: TurnSize, tiers: TierPolicy) -> int:
        """The whole history, the per-turn selection (the old one is replaced layer by layer), and
        one layer's scratch of the re-selection (the history's keys and values gathered)."""
        return (turn.token_bytes * turn.total + turn.token_bytes * turn.kept_after
                + turn.layer_bytes * 2 * (turn.fed + turn.new))

    @staticmethod
    def decode_tokens(turn: TurnSize) -> int:
        return turn.kept_after
