"""``rocketkv-mt``: the paper's multi-turn variant. The whole history stays on the device; every turn
re-runs Stage 1 over all of it with the new observation window into a per-turn cache that HSA reads."""
from __future__ import annotations

import torch

from rocketkv_mt.cache.rocketkv import RocketKVCache
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.reselect import reselect


class RocketKVMTCache(RocketKVCache):
    mode = "rocketkv-mt"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self.spec
        self.selected = [LayerKV(s.num_kv_heads, s.head_dim, s.dtype, s.device) for _ in range(s.num_layers)]

    def sparse_store(self, layer: int) -> LayerKV:
        return self.selected[layer]

    def after_prefill(self, layer: int, q: torch.Tensor, scaling: float) -> None:
        full, turn = self.layers[layer], self.selected[layer]
        split = self.split
        if full.length <= split.prompt_budget:
            turn.replace(full.keys, full.values, full.positions)
            self.anchors[layer] = None
        else:
            w = min(split.window_size, q.shape[1])
            slots, positions, scores = reselect(
                q[:, -w:], full.keys, full.positions, None, full.length, split.prompt_budget, split.kernel_size, scaling
            )
            idx = slots.unsqueeze(-1).expand(-1, -1, full.keys.shape[-1])
            turn.replace(torch.gather(full.keys, 1, idx), torch.gather(full.values, 1, idx), positions)
            self.on_selected(layer, scores)
        self.build_kt(layer)

    def _hsa_step(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        full = self.layers[layer]
        self.selected[layer].append(full.keys[:, -1:], full.values[:, -1:], full.positions[:, -1:])
        return super()._hsa_step(layer, q, scaling)

    def decode_target(self, layer: int):
        target = super().decode_target(layer)
        target.mirror = self.layers[layer]  # the whole history takes the token too, as in _hsa_step
        return target

    def kept_tokens(self) -> int:
        return self.layers[0].length

    def device_bytes(self) -> int:
        return super().device_bytes() + sum(layer.nbytes() for layer in self.selected)
