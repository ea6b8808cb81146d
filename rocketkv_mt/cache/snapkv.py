"""``snapkv``: Stage 1 at every turn's prefill; evicted tokens are gone for good."""
from __future__ import annotations

import torch

from rocketkv_mt.cache.base import SessionCache
from rocketkv_mt import dispatch
from rocketkv_mt.anchors import kept_scores
from rocketkv_mt.stage1 import keep_from_scores


class SnapKVCache(SessionCache):
    mode = "snapkv"

    def after_prefill(self, layer: int, q: torch.Tensor, scaling: float) -> None:
        split = self.step.split
        store = self.layers[layer]
        if store.length <= split.prompt_budget:
            return
        w = min(split.window_size, q.shape[1])
        scores = dispatch.window_scores(q[:, -w:], store.keys, scaling, backend=self.spec.kernels)
        keep = keep_from_scores(scores, w, split.prompt_budget, split.kernel_size)
        store.keep(keep)
        self.on_selected(layer, kept_scores(scores, keep[:, : keep.shape[1] - w], w))

    def on_selected(self, layer: int, scores: torch.Tensor) -> None:
        """Stage 1 kept tokens whose window scores (Hkv, kept) are given, in kept order."""
