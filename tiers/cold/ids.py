"""The names of a cache's cold pages, and the store groups they fall in.

A page is named ``p<epoch>.<batch>/<layer>.<k>``: its group (``tiers.store.protocol``) is the demotion
batch it was made in, every layer's pages of one turn together, so a session's pages make one store key
per turn rather than one per page and KV head; its field is its layer and its index in that batch.
The epoch is drawn at random by each cache and each restore of one (``PageNamer.renew``), so two copies
of a session (a stale replica and the one that took over) never write different bytes under one name.
Page tables keep ids packed in one int64: epoch, batch and index (the layer is the table's).
"""
from __future__ import annotations

import secrets

import torch

EPOCH_BITS, BATCH_BITS, INDEX_BITS = 27, 14, 22  # 63 bits: one non-negative int64


def page_id(layer: int, epoch: int, batch: int, k: int) -> str:
    return f"{group_name(epoch, batch)}/{layer}.{k}"


def group_name(epoch: int, batch: int) -> str:
    return f"p{epoch:07x}.{batch:x}"


def packed_id(pid: str) -> int:
    """A page id's epoch, batch and index in one int64 (how page tables store ids)."""
    group, _, field = pid.partition("/")
    epoch, _, batch = group[1:].partition(".")
    return (int(epoch, 16) << (BATCH_BITS + INDEX_BITS)) | (int(batch, 16) << INDEX_BITS) | int(field.partition(".")[2])


def unpacked_id(layer: int, packed: int) -> str:
    """The id of a page of ``layer`` from its ``packed_id``."""
    return page_id(layer, packed >> (BATCH_BITS + INDEX_BITS), (packed >> INDEX_BITS) & ((1 << BATCH_BITS) - 1),
                   packed & ((1 << INDEX_BITS) - 1))


def page_names(layer: int, index: dict[str, torch.Tensor]) -> list[str]:
    """The ids of the pages a layer's page table (``tiers.cold.persist.index_tensors``) names, every head's."""
    return [unpacked_id(layer, e) for name, ids in index.items() if name.startswith("ids") for e in ids.tolist()]


class PageNamer:
    """Names for one cache's new pages, shared by its layers: a batch a turn (``next_batch``), indices
    counted per layer within it. Ids are never used twice, not even those of a write that failed."""

    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        """A new epoch (a new cache, or a restored one): nothing named under it yet."""
        self.epoch = secrets.randbits(EPOCH_BITS)
        self.batch = 0
        self._next: dict[int, int] = {}

    def next_batch(self) -> None:
        """A turn begins: its pages go in a group of their own (unless the last batch named none)."""
        if self._next:
            self._next = {}
            self.batch += 1
            if self.batch >> BATCH_BITS:
                self.renew()

    def take(self, layer: int, m: int) -> list[str]:
        k = self._next.get(layer, 0)
        if (k + m) >> INDEX_BITS:
            raise ValueError(f"over {1 << INDEX_BITS} pages of one layer in one demotion batch")
        self._next[layer] = k + m
        return [page_id(layer, self.epoch, self.batch, k + j) for j in range(m)]
