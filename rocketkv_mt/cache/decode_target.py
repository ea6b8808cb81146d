"""What one session's decode step of one layer reads and writes, for the batched decode.

A cache in its decode phase describes its step as a ``DecodeTarget`` (``SessionCache.decode_target``,
built by its decode policy over the set its prefill policy chose): the store the new token joins
and that is attended, an optional mirror store that also receives the token, the KT bounds that
the new key tightens, and HSA's sizes (or none: dense attention over the store). ``BatchCache`` turns the targets of every decoding session into one table of rows
(``rocketkv_mt.decode_table``) and runs the whole layer's step in one kernel call; the targets then
count the token they received in place (``commit``).

Shapes: Hkv KV heads, d head dim, A pinned pages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import BudgetSplit
from rocketkv_mt.decode_table import WIDTH
from rocketkv_mt.hsa import local_pages, pages_read
from rocketkv_mt.kt_cache import KTCache


@dataclass
class DecodeTarget:
    """One session's decode step of one layer.

    store: receives the token's key/value/position, then is attended (its kept tokens, the new one
    included). mirror: also receives the token (the layer store, where the decode set is a per-turn
    selection beside it). kt: the store's page bounds, tightened with the new key. split: HSA's
    sizes when the step reads a sparse set, None for dense attention over the store. pinned
    (Hkv, A) int64: pages HSA always reads (the turn's anchors). lead: how early the stores grow
    (``LayerKV.reserve``), by layer.
    """

    store: LayerKV
    mirror: LayerKV | None = None
    kt: KTCache | None = None
    split: BudgetSplit | None = None
    pinned: torch.Tensor | None = None
    lead: int = 0

    def row(self, position: int) -> list[int]:
        """The table row of this step for a token at ``position``, with room made for it (buffers may
        move here, never during the kernel call)."""
        store, mirror, kt = self.store, self.mirror, self.kt
        store.reserve(store.length + 1, self.lead)
        keys, values = store.buffers
        row = [keys.data_ptr(), values.data_ptr(), store.position_buffer.data_ptr(), keys.shape[1], store.length, position]
        if mirror is not None:
            mirror.reserve(mirror.length + 1, self.lead)
            mk, mv = mirror.buffers
            row += [mk.data_ptr(), mv.data_ptr(), mirror.position_buffer.data_ptr(), mk.shape[1], mirror.length]
        else:
            row += [0] * 5
        if kt is not None:
            if kt.length != store.length:
                raise ValueError(f"KT bounds of {kt.length} tokens for a store of {store.length}")
            page, opens = kt.next_slot(self.lead // kt.page_size)
            bounds = kt.buffer
            row += [bounds.data_ptr(), bounds.stride(0), bounds.stride(1), page, int(opens)]
        else:
            row += [0] * 5
        row += self._attention(store.length + 1)
        assert len(row) == WIDTH
        return row

    def _attention(self, length: int) -> list[int]:
        """HSA, PAGES, PAGE_SIZE, TOPR, KPAGES, NLOCAL, PINNED, NPINNED for ``length`` kept tokens."""
        split = self.split
        if split is None:
            return [0] * 8
        if self.kt is None:
            raise ValueError("HSA needs the store's KT bounds")
        page = split.page_size
        pages = -(-length // page)
        n_local = local_pages(length, page, split.local_window)
        pinned, n_pinned = 0, 0
        if self.pinned is not None:
            if self.pinned.dtype != torch.int64 or not self.pinned.is_contiguous():
                self.pinned = self.pinned.to(torch.int64).contiguous()
            pinned, n_pinned = self.pinned.data_ptr(), self.pinned.shape[1]
        k_pages = pages_read(math.ceil(split.topk / page), n_local + n_pinned, pages)
        return [1, pages, page, min(split.topr, self.store.buffers[0].shape[2]), k_pages, n_local, pinned, n_pinned]

    def commit(self) -> None:
        """Count the token the kernel wrote in place."""
        self.store.appended()
        if self.mirror is not None:
            self.mirror.appended()
        if self.kt is not None:
            self.kt.appended()
