"""Hybrid Sparse Attention at decode: per layer, a KT cache (page key bounds) of the decode set
ranks its pages, and each step attends to the top-k pages only (``rocketkv_mt.hsa``)."""
from __future__ import annotations

import contextlib
import math

import torch

from rocketkv_mt import dispatch
from rocketkv_mt.anchors import anchor_pages
from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.base import CacheSpec
from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.cache.policy import TurnSize
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import BudgetSplit
from rocketkv_mt.kt_cache import KT_SPARE_PAGES, KTCache


@contextlib.contextmanager
def few_threads(t: torch.Tensor):
    """One CPU thread for HSA's chain of tiny ops: waking a thread pool costs more than the ops."""
    if t.is_cuda or torch.get_num_threads() == 1:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class HSADecode:
    """Per layer, the KT cache of the decode set and the anchor pages its prefill scored highest."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.kt: list[KTCache | None] = [None] * spec.num_layers
        # Per layer, the pages this turn's window scored highest (Hkv, A); None when nothing was selected.
        self.anchors: list[torch.Tensor | None] = [None] * spec.num_layers

    def prepare(self, layer: int, store: LayerKV, scores: torch.Tensor | None, split: BudgetSplit, lead: int) -> None:
        self.anchors[layer] = None if scores is None else anchor_pages(scores, split.page_size, split.anchor_pages)
        # No layer's bounds grow in the first decode step: the spare pages pass every layer's lead (each
        # under a store chunk), the same for all layers so that their leads still spread their growth.
        page = split.page_size
        spare = max(KT_SPARE_PAGES, store.chunk // page + 2)
        self.kt[layer] = KTCache(store.keys, page, spare, backend=self.spec.kernels, reuse=self.kt[layer],
                                 lead_pages=lead // page)

    def attend(self, layer: int, q: torch.Tensor, store: LayerKV, split: BudgetSplit, scaling: float) -> torch.Tensor:
        """q (Hq, 1, d) -> (Hq, 1, d)."""
        with few_threads(q):
            return self._step(layer, q, store, split, scaling)

    def _step(self, layer: int, q: torch.Tensor, store: LayerKV, split: BudgetSplit, scaling: float) -> torch.Tensor:
        self.kt[layer].append(store.keys[:, -1])
        # Reading every kept token costs no more than the budget: attend exactly.
        if store.length <= split.token_budget or layer < split.dense_layers:
            return dense_attention(q, store.keys, store.values, scaling)
        hkv = self.spec.num_kv_heads
        key_buf, value_buf = store.buffers
        out = dispatch.hsa_decode(
            q.reshape(hkv, -1, q.shape[-1]), key_buf, value_buf, store.length, self.kt[layer].bounds,
            split.page_size, split.topr, split.topk, scaling,
            local_window=split.local_window, pinned=self.anchors[layer], backend=self.spec.kernels,
        )
        return out.reshape(q.shape)

    def target(self, layer: int, store: LayerKV, split: BudgetSplit, mirror: LayerKV | None, lead: int) -> DecodeTarget:
        # As in _step, once the token is in: dense while every kept token fits the budget.
        sparse = store.length + 1 > split.token_budget and layer >= split.dense_layers
        return DecodeTarget(store, mirror, kt=self.kt[layer], split=split if sparse else None,
                            pinned=self.anchors[layer], lead=lead)

    def nbytes(self) -> int:
        return sum(kt.nbytes() for kt in self.kt if kt is not None)

    @staticmethod
    def bound(turn: TurnSize, decode_tokens: int) -> int:
        """A page's key bounds (max and min) take the bytes of one token's keys and values."""
        return turn.token_bytes * (math.ceil(decode_tokens / turn.split.page_size) + 2)
