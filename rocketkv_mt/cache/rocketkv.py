"""``rocketkv``: Stage 1 at prefill (permanent eviction) and Hybrid Sparse Attention at decode."""
from __future__ import annotations

import contextlib

import torch

from rocketkv_mt import dispatch
from rocketkv_mt.anchors import anchor_pages
from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.decode import DecodeTarget
from rocketkv_mt.cache.snapkv import SnapKVCache
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.kt_cache import KTCache


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


class RocketKVCache(SnapKVCache):
    mode = "rocketkv"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kt: list[KTCache | None] = [None] * self.spec.num_layers
        # Per layer, the pages this turn's window scored highest (Hkv, A); None when nothing was selected.
        self.anchors: list[torch.Tensor | None] = [None] * self.spec.num_layers

    def after_prefill(self, layer: int, q: torch.Tensor, scaling: float) -> None:
        self.anchors[layer] = None
        super().after_prefill(layer, q, scaling)
        self.build_kt(layer)

    def on_selected(self, layer: int, scores: torch.Tensor) -> None:
        self.anchors[layer] = anchor_pages(scores, self.split.page_size, self.split.anchor_pages)

    def build_kt(self, layer: int) -> None:
        self.kt[layer] = KTCache(self.sparse_store(layer).keys, self.split.page_size)

    def sparse_store(self, layer: int) -> LayerKV:
        """The tokens HSA reads at decode; they already include the token being decoded."""
        return self.layers[layer]

    def decode_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        with few_threads(q):
            return self._hsa_step(layer, q, scaling)

    def _hsa_step(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        store, kt, split = self.sparse_store(layer), self.kt[layer], self.split
        kt.append(store.keys[:, -1])
        # Reading every kept token costs no more than the budget: attend exactly.
        if store.length <= split.token_budget or layer < split.dense_layers:
            return dense_attention(q, store.keys, store.values, scaling)
        hkv = self.spec.num_kv_heads
        key_buf, value_buf = store.buffers
        out = dispatch.hsa_decode(
            q.reshape(hkv, -1, q.shape[-1]), key_buf, value_buf, store.length, kt.bounds,
            split.page_size, split.topr, split.topk, scaling,
            local_window=split.local_window, pinned=self.anchors[layer], backend=self.spec.kernels,
        )
        return out.reshape(q.shape)

    def decode_target(self, layer: int) -> DecodeTarget | None:
        store, split = self.sparse_store(layer), self.split
        sparse = store.length + 1 > split.token_budget and layer >= split.dense_layers  # as in _hsa_step
        return DecodeTarget(store, kt=self.kt[layer], split=split if sparse else None, pinned=self.anchors[layer])

    def device_bytes(self) -> int:
        return super().device_bytes() + sum(kt.nbytes() for kt in self.kt if kt is not None)
